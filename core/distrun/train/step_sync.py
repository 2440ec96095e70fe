"""Stop requests agreed by every rank at optimizer-step boundaries, apart from logging.

A stop is asked for locally: a signal (SIGTERM/SIGUSR1: preemption, save and exit 143 for
requeue; SIGINT the same with exit 130) or a plugin's :meth:`~distrun.train.run.Run.request_stop`
(early stopping: end the fit normally). The ranks vote at step boundaries in one small
all-reduce (MAX) that runs in the background while the next step computes; the result is read
at the next boundary, so every rank stops after the same step and no rank waits on the vote.
Votes are cast every ``VOTE_INTERVAL`` seconds of training (every step when steps are longer),
so a request ends the run within about that long plus one step.

The same boundary finishes other reductions the loop deferred (the logged metrics), so those
do not make the ranks wait either.

The object is a torch ``Joinable``: under ``Join`` (distrun-join) a rank that ran out of data
casts matching zero votes, and also matches the loop's metric reduction at log steps, so
neither stopping nor ``log_every_n_steps`` depends on the ranks having equal data.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Joinable, JoinHook

from distrun.spec.stash import StashKey

if TYPE_CHECKING:
    from distrun.train.run import Run

__all__ = ["FINISH", "NONE", "PREEMPT", "STEP_SYNC", "VOTE_INTERVAL", "StepSync"]

#: vote values, ordered: the largest request of any rank wins
NONE, FINISH, PREEMPT = 0, 1, 2


#: seconds of training between two votes. A vote is one tiny all-reduce, but on gloo it costs
#: ~0.3 ms of CPU per rank: cast at every step of a 3 ms step it took 15-20% of the step time
#: on the 2-core test machine. Steps longer than this still vote at every step.
VOTE_INTERVAL = 0.1
#: the most steps between two votes, however short the steps
MAX_EVERY = 1000


class StepSync(Joinable):
    """The collectives every rank runs at a step boundary, in one place (see module doc)."""

    def __init__(self, run: Run) -> None:
        super().__init__()
        self.run = run
        self.strategy = run.strategy
        # [request, seconds per step since the last vote], reduced with MAX
        self._vote = torch.zeros(2, dtype=torch.float64, device=run.strategy.device)
        self._pending: Any = None
        self._deferred: list[tuple[Any, Callable[[], None]]] = []
        self._last: tuple[int, float] | None = None  # (step, time) of the last vote cast
        #: steps between votes: ceil(VOTE_INTERVAL / the slowest rank's step time), from the
        #: last vote's result, so every rank computes the same cadence
        self.every = 1
        #: the step at whose boundary the next vote is cast
        self.next_vote = 0
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
        """At a step boundary: the results of the reductions in flight (the vote, deferred
        metrics) and, when one is due, this step's vote sent."""
        agreed = self._complete()
        step = self.run.progress.step
        if agreed == NONE and step >= self.next_vote:
            local = self.local_request()
            if not self._cast(step, float(local), self._seconds_per_step(step)):
                agreed = local  # one process: nobody to agree with
        self.agreed = agreed
        return agreed

    def defer(self, work: Any, done: Callable[[], None]) -> None:
        """Run ``done()`` once the async collective ``work`` finished: at the next boundary
        (or :meth:`flush`/:meth:`drain`), so no rank waits on it now. ``work`` None: now."""
        if work is None:
            done()
        else:
            self._deferred.append((work, done))

    def flush(self) -> None:
        """Finish the deferred reductions now (before validation logs its own row)."""
        deferred, self._deferred = self._deferred, []
        for work, done in deferred:
            work.wait()
            done()

    def drain(self) -> int:
        """At the end of an epoch or of the fit, where every rank is in step: finish what is in
        flight, then vote once more and wait for it, so a request made since the last vote is
        agreed before another epoch starts. Returns the agreement."""
        agreed = self._complete()
        if agreed == NONE:
            local = self.local_request()
            if self._cast(self.run.progress.step, float(local), 0.0):
                agreed = self._complete()
            else:
                agreed = local
        self.agreed = max(self.agreed, agreed)
        return self.agreed

    def _cast(self, step: int, request: float, seconds: float) -> bool:
        self._vote[0] = request
        self._vote[1] = seconds
        work = self.strategy.all_reduce_async(self._vote, "max")
        if work is None:
            return False
        self._pending = work
        self.next_vote = step + self.every
        return True

    def _seconds_per_step(self, step: int) -> float:
        now = time.perf_counter()
        last, self._last = self._last, (step, now)
        if last is None or step <= last[0]:
            return 0.0
        return (now - last[1]) / (step - last[0])

    def _complete(self) -> int:
        agreed = NONE
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
            request, seconds = self._vote.tolist()
            agreed = int(request)
            if seconds > 0:  # 0: nobody timed steps since the last vote (joined, epoch end)
                self.every = max(1, min(MAX_EVERY, math.ceil(VOTE_INTERVAL / seconds)))
        self.flush()
        return agreed

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

    At the micro-batch that ends a step it does what :meth:`StepSync.boundary` does there,
    with a zero vote (and learns the others' request and cadence); at a log step it takes part
    in the metric reduction (adding zeros) and logs the result, so rank 0 shows a row every
    ``log_every_n_steps`` even after it ran out of data.
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
        # The ranks still training finish the vote and reductions in flight at this boundary
        # and send this step's vote when one is due; the same ops in the same order here.
        agreed = sync._complete()
        if agreed != NONE:
            sync.agreed = max(sync.agreed, agreed)
        elif self.step >= sync.next_vote:
            sync._cast(self.step, 0.0, 0.0)
        if self.step % sync.log_every == 0 and sync.log_metrics is not None:
            sync.log_metrics(self.step)  # this rank's window is empty: it adds zeros

    def post_hook(self, is_last_joiner: bool) -> None:
        return None


#: the fit's :class:`StepSync`; distrun-join adds it (last) to the Joinables of an epoch
STEP_SYNC: StashKey[StepSync] = StashKey("loop.step_sync")
