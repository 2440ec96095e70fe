"""The torch schedules behind ``--pp-schedule`` and where each one places its stages."""

from __future__ import annotations

from typing import Any

from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

__all__ = ["SCHEDULES", "bubble", "placement", "virtual_stages"]

#: name -> (torch class, several stages per rank)
SCHEDULES: dict[str, tuple[Any, bool]] = {
    "gpipe": (ScheduleGPipe, False),
    "1f1b": (Schedule1F1B, False),
    "interleaved-1f1b": (ScheduleInterleaved1F1B, True),
    # zero-bubble with the looped placement; torch's V-shaped ScheduleZBVZeroBubble fails in
    # eval() in torch 2.13 ("can't steal_bwd_input if this stage doesn't have backward")
    "zero-bubble": (ScheduleInterleavedZeroBubble, True),
}


def virtual_stages(name: str, requested: int) -> int:
    """Stages per rank: 1 for the single-stage schedules, else ``requested``."""
    return requested if SCHEDULES[name][1] else 1


def placement(pp: int, v: int) -> list[int]:
    """The pp rank of each stage: looped (stage s on rank s mod pp)."""
    return [s % pp for s in range(pp * v)]


def bubble(pp: int, microbatches: int, v: int = 1) -> float:
    """The idle fraction a schedule predicts: (p-1)/(m+p-1), with v stages per rank
    (interleaved) the bubble shrinks v-fold: (p-1)/(v*m+p-1)."""
    return (pp - 1) / (v * microbatches + pp - 1)
