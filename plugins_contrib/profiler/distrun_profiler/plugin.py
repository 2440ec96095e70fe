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

from distrun.plugin import StashKey, hookimpl, plugin_options

if TYPE_CHECKING:
    from distrun_profiler.profiling import StepProfiler

DISTRUN_PLUGIN_API = 1  # the distrun.plugin API this plugin is written for

__all__ = ["PROFILER"]

#: the fit's profiler (every rank), while ``--profile`` is on
PROFILER: StashKey[StepProfiler] = StashKey("profiler")


@hookimpl
def distrun_register_options(register):
    opt = plugin_options(register, "profiler")
    opt("profile", bool, False,
        "trace a few training steps with torch.profiler (a trace per rank in RUN_DIR/profiler)")
    opt("profile_wait", int, 1, "steps to skip before the profiler starts warming up", min=0)
    opt("profile_warmup", int, 2, "steps traced but thrown away (warm-up)", min=0)
    opt("profile_steps", int, 5, "steps recorded into the trace", min=1)
    opt("profile_dir", str, "", "trace folder (default: RUN_DIR/profiler)", metavar="DIR")
    opt("profile_memory", bool, False, "record tensor allocations (memory view)")
    opt("profile_shapes", bool, False, "record input shapes of the ops")
    opt("profile_stack", bool, False, "record Python stacks of the ops (larger traces)")
    opt("profile_top", int, 5, "ops named in rank 0's summary line (0: no summary)", min=0)


@hookimpl
def distrun_on_fit_start(run):
    if not run.config.get("profile", False) or getattr(run, "stage", "fit") != "fit":
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
