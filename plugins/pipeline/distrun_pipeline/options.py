"""The pipeline plugin's options, read typed with ``PipelineOptions.of(config)`` (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from distrun.plugin import PluginOptions, option

#: --pp-schedule names (see distrun_pipeline.schedules)
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")


@dataclass(frozen=True)
class PipelineOptions(PluginOptions, plugin="pipeline"):
    """The pipeline plugin's options (``PipelineOptions.of(config)``)."""

    pp: int = option(
        0, "pipeline stages over ranks (0: every rank under --strategy pp; with pp+ddp / pp+fsdp "
        "the world size / N ranks are data parallel)",
        min=0)
    pp_schedule: str = option(
        "1f1b", "the torch.distributed.pipelining schedule",
        choices=SCHEDULES)
    microbatches: int = option(
        0, "micro-batches per step, splitting each rank's batch (0: 2 x stages)",
        min=0)
    pp_virtual_stages: int = option(
        2, "stages per rank for interleaved-1f1b and zero-bubble",
        min=1)
