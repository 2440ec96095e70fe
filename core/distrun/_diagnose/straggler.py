"""The slow rank: each rank's compute time per step, compared at the step boundary.

A synchronous job runs at the pace of its slowest rank, and its collectives hide which one
that is: under DDP every rank's step takes as long, the others' extra time spent waiting in
the gradient all-reduce. What differs is the time a rank spends on its own: loading data,
its ``training_step`` (the forward) and the optimizer step, read from its position record
(:meth:`~distrun._diagnose.position.Recorder.totals`). Backward is left out: under DDP and
FSDP it holds the wait for the others.

Each rank adds its own times to a reduction its loop runs anyway (a sum in which the other
ranks' slots are zeros: :class:`ComputeTimes`): the step boundary's
(:class:`~distrun._train.step_sync.StepSync`), and under ``--ft`` the replica group's log
reduction and the gradients' all-reduce across the groups (distrun-ft, through
:meth:`~distrun._train.run.Run.compute_times`). So every rank learns every rank's times with
no collective of its own. :class:`Stragglers` judges them, the same way on every rank: a
window closes after :data:`WINDOW_STEPS` steps; a rank whose compute time in a window is at
least :data:`SLOWER` times the median of the others', and :data:`MIN_EXCESS` seconds a step
more, is slow in that window; slow in :data:`SUSTAINED` windows in a row, it is named (once
a run per rank). Torch-free.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

from distrun._diagnose.position import Phase, recorder

__all__ = ["PHASES", "SLOTS", "ComputeTimes", "Spread", "Stragglers"]

#: the phases a rank spends on its own, in the order of its slots
PHASES = ("data", "forward", "optimizer")
_OWN = (Phase.DATA, Phase.FORWARD, Phase.OPTIMIZER)  # (PHASES, as the record's phases)
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

    def __init__(self, world_size: int, host: str = "",
                 name: Callable[[int], str] | None = None) -> None:
        self.world_size = world_size
        self.host = host
        #: what a line calls the n-th of those compared (None: ``rank n (host h)``)
        self.name = name
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
        if self.name is not None:
            who = self.name(rank)
        else:
            who = f"rank {rank} (host {self.host})" if len(set(self._nodes)) == 1 and \
                self.host else f"rank {rank} (node {self._nodes[rank]})"
        ratio = sum(own) / others if others else float("inf")
        longer = f"{ratio:.1f}x as long as" if ratio >= 2 else f"{(ratio - 1) * 100:.0f}% " \
            "longer than"
        return (f"{who} computes {longer} the others for "
                f"{SUSTAINED * WINDOW_STEPS} steps: {PHASES[worst]} {own[worst] * 1e3:.1f} ms "
                f"vs {medians[worst] * 1e3:.1f} ms a step (the whole run waits for it)")


class ComputeTimes:
    """This rank's side of the comparison, for a SUM reduction its loop already runs.

    ``world`` take part, this rank as the ``index``-th, timed from step ``start`` on (the
    step its loop starts at): :meth:`pack` gives the :attr:`size`
    floats it adds to the reduction (its seconds per step in each of :data:`PHASES` since it
    last packed, and its node; zeros in the others' places), :meth:`add` judges what the
    reduction summed (:class:`Stragglers`, the same on every rank). Each instance reads the
    rank's record on its own: a loop may keep several (distrun-ft: the group's ranks, and this
    rank against its counterparts in the other replica groups)."""

    def __init__(self, world: int, index: int, start: int, host: str = "", node: int = 0,
                 name: Callable[[int], str] | None = None) -> None:
        self.size = world * SLOTS
        self.index, self.node = index, node
        self.judge = Stragglers(world, host, name)
        self._rec = recorder()
        self._totals = self._rec.totals() if self._rec is not None else []
        self._step = start  # the step last packed at (first: the step the loop starts at)
        self._steps = 0  # the steps the last pack timed

    def pack(self, step: int) -> list[float]:
        """This rank's floats for the reduction at (the end of) step ``step``."""
        slots = [0.0] * self.size
        self._steps, self._step = step - self._step, step
        if self._rec is None or self._steps <= 0:
            return slots
        totals, before = self._rec.totals(), self._totals
        self._totals = totals
        at = self.index * SLOTS
        for i, phase in enumerate(_OWN):
            slots[at + i] = (totals[phase] - before[phase]) / self._steps
        slots[at + SLOTS - 1] = float(self.node)
        return slots

    def add(self, summed: list[float]) -> str | None:
        """The reduction's sum of every rank's :meth:`pack` (of the steps this rank's last
        pack timed): a line naming a rank when one became a straggler."""
        return self.judge.add(summed, self._steps)

    @property
    def spread(self) -> Spread | None:
        """The last closed window's spread (None: none closed yet)."""
        return self.judge.spread
