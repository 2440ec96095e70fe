"""The slow rank: each rank's compute time per step, compared at the step boundary.

A synchronous job runs at the pace of its slowest rank, and its collectives hide which one
that is: under DDP every rank's step takes as long, the others' extra time spent waiting in
the gradient all-reduce. What differs is the time a rank spends on its own: loading data,
its ``training_step`` (the forward) and the optimizer step, read from its position record
(:meth:`~distrun._diagnose.position.Recorder.take_times`). Backward is left out: under DDP and
FSDP it holds the wait for the others.

Each rank adds its own times to the step boundary's existing reduction (a sum in which the
other ranks' slots are zeros, :class:`~distrun._train.step_sync.StepSync`), so every rank
learns every rank's times with no collective of its own. This module judges them, the same
way on every rank: a window closes after :data:`WINDOW_STEPS` steps; a rank whose compute
time in a window is at least :data:`SLOWER` times the median of the others', and
:data:`MIN_EXCESS` seconds a step more, is slow in that window; slow in
:data:`SUSTAINED` windows in a row, it is named (once a run per rank). Torch-free.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

__all__ = ["PHASES", "SLOTS", "Spread", "Stragglers"]

#: the phases a rank spends on its own, in the order of its slots
PHASES = ("data", "forward", "optimizer")
#: slots per rank in the reduction: each phase's seconds per step, then the rank's node
SLOTS = len(PHASES) + 1
#: a window's steps, its slowness ratio and least excess, and the windows in a row
WINDOW_STEPS = 100
SLOWER = 1.2
MIN_EXCESS = 0.001
SUSTAINED = 2


@dataclass(frozen=True)
class Spread:
    """The compute times per step of the last window: the slowest rank's, the fastest's."""

    slowest_rank: int
    slowest: float
    fastest: float


class Stragglers:
    """Judges the ranks' compute times as the reductions bring them (see module doc)."""

    def __init__(self, world_size: int, host: str = "") -> None:
        self.world_size = world_size
        self.host = host
        self._sums = [[0.0] * len(PHASES) for _ in range(world_size)]
        self._steps = [0.0] * world_size
        self._nodes = [0] * world_size
        self._window = 0
        self._slow: dict[int, int] = {}  # rank -> slow windows in a row
        self.named: set[int] = set()
        #: the last closed window's spread (None: none closed yet)
        self.spread: Spread | None = None

    def add(self, values: list[float], steps: int) -> str | None:
        """One reduction's slots (``SLOTS`` per rank: each phase's seconds per step, the
        node) over ``steps`` steps; a line naming a rank when one became a straggler."""
        if steps <= 0:
            return None
        for rank in range(self.world_size):
            slot = values[rank * SLOTS:(rank + 1) * SLOTS]
            if not any(slot[:len(PHASES)]):
                continue  # it timed nothing (joined, or no record)
            for i in range(len(PHASES)):
                self._sums[rank][i] += slot[i] * steps
            self._steps[rank] += steps
            self._nodes[rank] = int(slot[-1])
        self._window += steps
        if self._window < WINDOW_STEPS:
            return None
        return self._close()

    def _close(self) -> str | None:
        per_step = {r: [s / self._steps[r] for s in self._sums[r]]
                    for r in range(self.world_size) if self._steps[r]}
        self._sums = [[0.0] * len(PHASES) for _ in range(self.world_size)]
        self._steps = [0.0] * self.world_size
        self._window = 0
        if len(per_step) < 2:
            return None
        total = {r: sum(v) for r, v in per_step.items()}
        slowest = max(total, key=lambda r: total[r])
        self.spread = Spread(slowest, total[slowest], min(total.values()))
        said = None
        for rank, own in total.items():
            others = statistics.median(t for r, t in total.items() if r != rank)
            if own >= SLOWER * others and own - others >= MIN_EXCESS:
                self._slow[rank] = self._slow.get(rank, 0) + 1
            else:
                self._slow.pop(rank, None)
                continue
            if self._slow[rank] >= SUSTAINED and rank not in self.named:
                self.named.add(rank)
                said = said or self._line(rank, per_step, others)
        return said

    def _line(self, rank: int, per_step: dict[int, list[float]], others: float) -> str:
        own = per_step[rank]
        medians = [statistics.median(v[i] for r, v in per_step.items() if r != rank)
                   for i in range(len(PHASES))]
        worst = max(range(len(PHASES)), key=lambda i: own[i] - medians[i])
        nodes = set(self._nodes)
        where = f"host {self.host}" if len(nodes) == 1 and self.host else \
            f"node {self._nodes[rank]}"
        ratio = sum(own) / others if others else float("inf")
        longer = f"{ratio:.1f}x as long as" if ratio >= 2 else f"{(ratio - 1) * 100:.0f}% " \
            "longer than"
        return (f"rank {rank} ({where}) computes {longer} the others for "
                f"{SUSTAINED * WINDOW_STEPS} steps: {PHASES[worst]} {own[worst] * 1e3:.1f} ms "
                f"vs {medians[worst] * 1e3:.1f} ms a step (the whole run waits for it)")
