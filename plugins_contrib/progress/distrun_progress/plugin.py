"""Entry point of distrun-progress: a progress bar on rank 0 (torch-free at import).

Under ``distrun run`` workers write into pipes, so the launcher hands rank 0 the path of its
own terminal (``DISTRUN_PROGRESS_TTY``) when its stdout is one; the bar draws there. Without
a terminal (CI logs, ``| tee``) the plugin prints a plain line every ``--progress-interval``
seconds instead. Either way it mutes the core's console line for the run.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from distrun.plugin import StashKey, hookimpl, keys
from distrun_progress.display import TTY_ENV, make_display
from distrun_progress.options import ProgressOptions
from distrun_progress.shared_terminal import clearing_lines

DISTRUN_PLUGIN_API = 1  # the distrun.plugin API this plugin is written for

#: set by the launcher for the workers: the terminal rank 0 may draw the bar on
_KEY: StashKey[Any] = StashKey("progress")  # the display


@hookimpl
def distrun_register_options(register):
    register(ProgressOptions)


@hookimpl(wrapper=True)
def distrun_launch(config, command, environ):
    # Any launcher's workers inherit `environ`: tell them which terminal the user watches.
    if ProgressOptions.of(config).progress and TTY_ENV not in environ:
        try:
            if sys.stdout.isatty():
                environ[TTY_ENV] = os.ttyname(sys.stdout.fileno())
        except (OSError, ValueError):
            pass
    tty = environ.get(TTY_ENV)
    opts = ProgressOptions.of(config)
    if not tty or not opts.progress or opts.progress_mode == "lines":
        return (yield)
    # Rank 0's bar and the lines the launcher relays share that terminal: each relayed line
    # clears the bar's line first, so no stale frame is left under it (shared_terminal.py).
    with clearing_lines(tty):
        return (yield)


@hookimpl(trylast=True)  # after the core's model summary, so the bar starts below it
def distrun_on_fit_start(run):
    if not run.is_global_zero or not ProgressOptions.of(run.config).progress:
        return
    display = run.stash[_KEY] = make_display(run)
    run.stash[keys.CONSOLE_OWNER] = "progress"
    run.add_hooks(Bar(display))  # rank 0 only: the other ranks' steps never pass here


class Bar:
    """The display's hooks, registered for the fit on rank 0 when progress is on."""

    def __init__(self, display: Any) -> None:
        self.display = display

    @hookimpl
    def distrun_on_step_end(self, run, step, metrics):
        self.display.on_step(run, step, metrics)

    @hookimpl
    def distrun_log_metrics(self, run, step, metrics):
        self.display.on_metrics(run, step, metrics)

    @hookimpl
    def distrun_on_fit_end(self, run):
        self.display.finish(run)


@hookimpl
def distrun_teardown(run):
    display = run.stash.pop(_KEY, None)
    if display is not None:
        display.close()
        # The console line is ours only while the bar shows the fit: the stages after it
        # (`--stage fit,test`) print their results through it again.
        if run.stash.get(keys.CONSOLE_OWNER) == "progress":
            del run.stash[keys.CONSOLE_OWNER]
