"""The profiler plugin's options, read typed with ``ProfilerOptions.of(config)`` (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from distrun.plugin import PluginOptions, option


@dataclass(frozen=True)
class ProfilerOptions(PluginOptions, plugin="profiler"):
    """The profiler plugin's options (``ProfilerOptions.of(config)``)."""

    profile: bool = option(
        False,
        "trace a few training steps with torch.profiler (a trace per rank in RUN_DIR/profiler)")
    profile_wait: int = option(1, "steps to skip before the profiler starts warming up", min=0)
    profile_warmup: int = option(2, "steps traced but thrown away (warm-up)", min=0)
    profile_steps: int = option(5, "steps recorded into the trace", min=1)
    profile_dir: str = option("", "trace folder (default: RUN_DIR/profiler)", metavar="DIR")
    profile_memory: bool = option(False, "record tensor allocations (memory view)")
    profile_shapes: bool = option(False, "record input shapes of the ops")
    profile_stack: bool = option(False, "record Python stacks of the ops (larger traces)")
    profile_top: int = option(5, "ops named in rank 0's summary line (0: no summary)", min=0)
