"""Entry point of distrun-profiler: torch.profiler traces of a few training steps per rank.

With ``--profile``, each rank runs ``torch.profiler`` over ``--profile-wait`` skipped steps,
``--profile-warmup`` warm-up steps and ``--profile-steps`` recorded ones, and writes its
trace into ``RUN_DIR/profiler`` (TensorBoard's profiler plugin, Perfetto and
chrome://tracing open it). Rank 0 then says which ops took the most time, in one line.
Without ``--profile`` the plugin adds no per-step hook: its step hook is registered for the
fit only when profiling (``run.add_hooks``). This module does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distrun.plugin import StashKey, hookimpl
from distrun_profiler.options import ProfilerOptions

if TYPE_CHECKING:
    from distrun_profiler.profiling import StepProfiler

DISTRUN_PLUGIN_API = 1  # the distrun.plugin API this plugin is written for

__all__ = ["PROFILER"]

#: the fit's profiler (every rank), while ``--profile`` is on
PROFILER: StashKey[StepProfiler] = StashKey("profiler")


@hookimpl
def distrun_register_options(register):
    register(ProfilerOptions)


@hookimpl
def distrun_on_fit_start(run):
    if not ProfilerOptions.of(run.config).profile or getattr(run, "stage", "fit") != "fit":
        return
    from distrun_profiler.profiling import StepProfiler

    profiler = run.stash[PROFILER] = StepProfiler(run)
    profiler.start()
    run.add_hooks(profiler)


@hookimpl
def distrun_teardown(run):
    profiler = run.stash.pop(PROFILER, None)
    if profiler is not None:
        profiler.finish(run)
