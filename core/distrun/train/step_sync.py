"""Stop requests agreed by every rank at optimizer-step boundaries, apart from logging.

A stop is asked for locally: a signal (SIGTERM/SIGUSR1: preemption, save and exit 143 for
requeue; SIGINT the same with exit 130) or a plugin's :meth:`~distrun.train.run.Run.request_stop` (early stopping: end the
fit normally). Each rank casts its vote at every step boundary in one small all-reduce (MAX)
that runs in the background while the next step computes; the result is read at the next
boundary, so every rank stops after the same step and no rank waits on the vote. A request
therefore ends the run at most one step after the step during which it arrived.

The object is a torch ``Joinable``: under ``Join`` (distrun-join) a rank that ran out of data
casts matching zero votes, and also matches the loop's metric reduction at log steps, so
neither stopping nor ``log_every_n_steps`` depends on the ranks having equal data.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Joinable, JoinHook

from distrun.spec.stash import StashKey

if TYPE_CHECKING:
    from distrun.train.run import Run

__all__ = ["FINISH", "NONE", "PREEMPT", "STEP_SYNC", "StepSync"]

#: vote values, ordered: the largest request of any rank wins
NONE, FINISH, PREEMPT = 0, 1, 2


class StepSync(Joinable):
    """The collectives every rank runs at a step boundary, in one place (see module doc)."""

    def __init__(self, run: Run) -> None:
        super().__init__()
        self.run = run
        self.strategy = run.strategy
        self._vote = torch.zeros(1, dtype=torch.float64, device=run.strategy.device)
        self._pending: Any = None
        #: what the ranks agreed on at the last boundary (NONE, FINISH or PREEMPT)
        self.agreed = NONE
        #: log steps that ranks still training reduce metrics at (set by the loop)
        self.log_every = run.config.log_every_n_steps
        self.grad_accum = run.config.grad_accum
        #: the loop's metric reduction and logging for a step, which joined ranks run too
        self.log_metrics: Callable[[int], None] | None = None

    # -- the loop's side -------------------------------------------------------------------
    def local_request(self) -> int:
        run = self.run
        if run.stop_signal is not None:
            return PREEMPT
        return FINISH if run.stop_requested else NONE

    def boundary(self) -> int:
        """At a step boundary: the result of the previous vote, and this step's vote sent."""
        agreed = self._collect()
        if agreed == NONE:
            local = self.local_request()
            self._vote.fill_(float(local))
            self._pending = self.strategy.all_reduce_async(self._vote, "max")
            if self._pending is None:  # one process: nobody to agree with
                agreed = local
        self.agreed = agreed
        return agreed

    def drain(self) -> int:
        """Wait for the vote in flight (end of an epoch or of the fit); return the agreement."""
        self.agreed = max(self.agreed, self._collect())
        return self.agreed

    def _collect(self) -> int:
        if self._pending is None:
            return NONE
        self._pending.wait()
        self._pending = None
        return int(self._vote.item())

    # -- Joinable: what a rank that ran out of data does while the others still train ------
    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _Shadow(self)

    @property
    def join_device(self) -> torch.device:
        return self._vote.device

    @property
    def join_process_group(self) -> Any:
        return dist.group.WORLD


class _Shadow(JoinHook):
    """Run on a joined rank once per iteration of the ranks still training (one micro-batch).

    At the micro-batch that ends a step it casts a zero vote (and learns the others' request);
    at a log step it takes part in the metric reduction (adding zeros) and logs the result, so
    rank 0 shows a row every ``log_every_n_steps`` even after it ran out of data.
    """

    def __init__(self, sync: StepSync) -> None:
        self.sync = sync
        self.micro = 0
        self.step: int | None = None  # the step this rank joined at (hooks are made earlier)

    def main_hook(self) -> None:
        sync = self.sync
        if self.step is None:
            self.step = sync.run.progress.step
        self.micro += 1
        if self.micro % sync.grad_accum:
            return
        self.step += 1
        # The ranks still training wait at this boundary for the vote of the previous one and
        # then send this one; the matching op here is the previous vote still in flight (or,
        # after the first, the zero vote below), so only the order of ops has to agree.
        agreed = sync._collect()
        if agreed != NONE:
            sync.agreed = max(sync.agreed, agreed)
        else:
            sync._vote.zero_()
            sync._pending = sync.strategy.all_reduce_async(sync._vote, "max")
        if self.step % sync.log_every == 0 and sync.log_metrics is not None:
            sync.log_metrics(self.step)  # this rank's window is empty: it adds zeros

    def post_hook(self, is_last_joiner: bool) -> None:
        return None


#: the fit's :class:`StepSync`; distrun-join adds it (last) to the Joinables of an epoch
STEP_SYNC: StashKey[StepSync] = StashKey("loop.step_sync")
