"""Stop requests and logged metrics agreed by every rank at optimizer-step boundaries.

A stop is asked for locally: a signal (SIGTERM/SIGUSR1: preemption, save and exit 143 for
requeue; SIGINT the same with exit 130) or a plugin's :meth:`~distrun._train.run.Run.request_stop`
(early stopping: end the fit normally). The ranks vote at step boundaries in one small
all-reduce (SUM of per-rank flags and counts) that runs in the background while the next step computes; the result is read
at the next boundary, so every rank stops after the same step and no rank waits on the vote.
Votes are cast every ``VOTE_INTERVAL`` seconds of training (every step when steps are longer),
so a request ends the run within about that long plus one step.

The logged metrics ride in the same reduction: at a log step the loop packs its window
(loss sum, micro-batches, samples) and the next vote carries every window packed since the
last, so the rows are exact sums over ranks, logged in order a little later (at most one vote
interval plus one step), and logging adds no collective of its own. On gloo a collective costs
~1 ms of a busy 2-core machine: one per log step (every 10 steps) took ~5% of a 2 ms step.

The object is a torch ``Joinable``: under ``Join`` (distrun-join) a rank that ran out of data
casts matching zero votes, and also matches the loop's metric reduction at log steps, so
neither stopping nor ``log_every_n_steps`` depends on the ranks having equal data.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Joinable, JoinHook

from distrun._spec.keys import STEP_SYNC

if TYPE_CHECKING:
    from distrun._train.run import Run

__all__ = ["FINISH", "NONE", "PREEMPT", "STEP_SYNC", "VOTE_INTERVAL", "StepSync"]

log = logging.getLogger("distrun")

#: vote values, ordered: the largest request of any rank wins
NONE, FINISH, PREEMPT = 0, 1, 2


#: seconds of training between two votes. A collective costs ~0.3 ms of CPU per rank on gloo
#: and, on a busy 2-core machine, 1-1.5 ms of the calling thread's time: cast at every step of
#: a 3 ms step, the vote alone took 15-20% of the step time. Steps longer than this vote at
#: every step; log steps carry the vote with the metrics (no second collective).
VOTE_INTERVAL = 0.1
#: the most steps between two votes, however short the steps
MAX_EVERY = 1000
#: the vote's part of a reduction (SUM): ranks asking to finish, to preempt; seconds per step
#: since the last reduction and the ranks that timed it (joined ranks add zeros)
_VOTE = 4

#: the largest world whose ranks' compute times ride in the reduction (SLOTS floats a rank)
MAX_TIMED_WORLD = 1024

#: the loop's metrics for a log step: ``pack(step) -> (tensor, done)``, where ``tensor`` is
#: float64 values to sum over ranks and ``done(summed)`` logs them
MetricsPacker = Callable[[int], tuple[torch.Tensor, Callable[[torch.Tensor], None]]]


class StepSync(Joinable):
    """The collectives every rank runs at a step boundary, in one place (see module doc)."""

    def __init__(self, run: Run, pack_metrics: MetricsPacker | None = None) -> None:
        super().__init__()
        self.run = run
        self.strategy = run.strategy
        self.device = run.strategy.device
        self.alone = run.world_size < 2  # nobody to agree with: requests act at once
        # in flight: (work, summed tensor, each window's (done callback, size))
        self._pending: tuple[Any, torch.Tensor, list[tuple[Callable[[torch.Tensor], None],
                                                           int]]] | None = None
        # log steps' windows packed since the last reduction: sent with the next vote
        self._windows: list[tuple[torch.Tensor, Callable[[torch.Tensor], None]]] = []
        self._early = NONE  # an agreement read before its boundary (flush)
        self._last: tuple[int, float] | None = None  # (step, time) of the last reduction
        #: steps between reductions: ceil(VOTE_INTERVAL / the ranks' mean step time), from
        #: the last result, so every rank computes the same cadence
        self.every = 1
        #: the step at whose boundary the next reduction is due
        self.next_vote = 0
        #: what the ranks agreed on at the last boundary (NONE, FINISH or PREEMPT)
        self.agreed = NONE
        #: log steps: the loop packs its metrics there (joined ranks pack their empty window)
        self.log_every = run.config.log_every_n_steps
        self.grad_accum = run.config.grad_accum
        #: the loop's metrics of a log step (None: this sync logs nothing, it only votes)
        self.pack_metrics = pack_metrics
        #: the last step whose window was packed (a commit packs its step's before its boundary)
        self._packed = -1
        #: while a checkpoint is saved: the reduced windows, logged once it is (None: log now)
        self._held: list[tuple[Callable[[torch.Tensor], None], torch.Tensor]] | None = None
        #: each rank's compute time per step, in the reduction (distrun._diagnose.straggler)
        self.times = run.compute_times()
        self._timed = 0 if self.alone or run.world_size > MAX_TIMED_WORLD else self.times.size

    # -- the loop's side -------------------------------------------------------------------
    def local_request(self) -> int:
        run = self.run
        if run.stop_signal is not None:
            return PREEMPT
        return FINISH if run.stop_requested else NONE

    def boundary(self, shadowed: int | None = None) -> int:
        """At a step boundary: the result of the reduction in flight; at a log step the
        metrics packed; when due, one reduction sent with the vote and every window packed
        since the last. Returns the agreement (NONE, FINISH or PREEMPT).

        ``shadowed``: the step a joined rank matches (it votes NONE and times nothing).
        """
        step = self.run.progress.step if shadowed is None else shadowed
        agreed = max(self._complete(), self._early)
        self._early = NONE
        if self.log_every and step % self.log_every == 0 and step != self._packed:
            self._pack(step)
        if step >= self.next_vote:
            local = self.local_request() if shadowed is None else NONE
            seconds = self._seconds_per_step(step) if shadowed is None else 0.0
            if not self._send(step, local, seconds):
                agreed = max(agreed, local)  # one process: nobody to agree with
        self.agreed = agreed if shadowed is None else max(self.agreed, agreed)
        return agreed

    def flush(self) -> None:
        """Reduce and log the metrics packed so far now (before validation logs its row;
        every rank validates at the same step); the vote's agreement counts at the next
        boundary."""
        agreed = self._complete()
        if self._windows and self._send(self.run.progress.step, self.local_request(), 0.0):
            agreed = max(agreed, self._complete())
        self._early = max(self._early, agreed)

    def reduce_for_commit(self) -> None:
        """Before a checkpoint is saved (every rank saves together): reduce the windows of
        every step it holds, the current log step's included, while every rank is still
        there; :meth:`log_held` logs them once it is saved. A rank that dies after the commit
        cannot take those rows with it then, and a run resumed from the checkpoint does not
        train those steps again. Logged after the save, not before: a row that makes a
        checkpoint plugin save the same step (a monitored metric) finds it saved."""
        if self.pack_metrics is None:
            return
        self._held = []
        step = self.run.progress.step
        if self.log_every and step % self.log_every == 0 and step != self._packed \
                and step > 0:
            self._pack(step)
        self.flush()

    def log_held(self) -> None:
        """Log the rows :meth:`reduce_for_commit` reduced, in order, every one: a stop signal
        that comes meanwhile (a peer died after the commit) waits until they are logged."""
        held, self._held = self._held or [], None
        with self.run.stop_signals_held():
            for done, summed in held:
                done(summed)

    def drain(self, metrics: bool = False) -> int:
        """At the end of an epoch or of the fit (``metrics``: the last, partial window too),
        where every rank is in step: finish what is in flight, vote once more and wait for
        it, so a request made since the last vote is agreed before another epoch starts."""
        agreed = max(self._complete(), self._early)
        self._early = NONE
        if metrics:
            self._pack(self.run.progress.step)
        local = self.local_request()
        if self._send(self.run.progress.step, local, 0.0):
            agreed = max(agreed, self._complete())
        else:
            agreed = max(agreed, local)
        self.agreed = max(self.agreed, agreed)
        return self.agreed

    # -- one reduction: the vote and the packed metrics ------------------------------------
    def _pack(self, step: int) -> None:
        if self.pack_metrics is None:
            return
        packed, done = self.pack_metrics(step)
        self._packed = step
        if self.alone:
            self._log(done, packed)  # one process: its values are the totals
        else:
            self._windows.append((packed, done))

    def _send(self, step: int, request: int, seconds: float) -> bool:
        """Start the reduction of this step; False when there is one process (done now)."""
        if self.alone:
            return False
        head = [float(request == FINISH), float(request == PREEMPT), seconds,
                1.0 if seconds > 0 else 0.0]
        if self._timed:
            head.extend(self.times.pack(step) if seconds > 0 else [0.0] * self._timed)
        head_t = torch.tensor(head, dtype=torch.float64, device=self.device)
        windows, self._windows = self._windows, []
        buf = torch.cat([head_t, *(p.to(self.device, torch.float64) for p, _ in windows)]) \
            if windows else head_t
        work = self.strategy.all_reduce_async(buf, "sum")
        dones = [(done, packed.numel()) for packed, done in windows]
        if work is None:  # a strategy that does not reduce over the world
            self._finish(buf, dones)
            return False
        self._pending = (work, buf, dones)
        self.next_vote = step + self.every
        return True

    def _seconds_per_step(self, step: int) -> float:
        now = time.perf_counter()
        last, self._last = self._last, (step, now)
        if last is None or step <= last[0]:
            return 0.0
        return (now - last[1]) / (step - last[0])

    def _complete(self) -> int:
        if self._pending is None:
            return NONE
        work, buf, dones = self._pending
        self._pending = None
        work.wait()
        finish, preempt, seconds, timers = buf[:_VOTE].tolist()
        if timers > 0:  # nobody timed steps at an epoch end or when all but one joined
            per_step = seconds / timers
            self.every = max(1, min(MAX_EVERY, math.ceil(VOTE_INTERVAL / per_step))) \
                if per_step > 0 else MAX_EVERY
            if self._timed:
                said = self.times.add(buf[_VOTE:_VOTE + self._timed].tolist())
                if said and self.run.is_global_zero:
                    log.warning("warning: %s", said)
        self._finish(buf, dones)
        return PREEMPT if preempt > 0 else FINISH if finish > 0 else NONE

    def _finish(self, buf: torch.Tensor,
                dones: list[tuple[Callable[[torch.Tensor], None], int]]) -> None:
        """Hand each packed window its summed values, in the order they were packed."""
        pos = _VOTE + self._timed
        for done, size in dones:
            self._log(done, buf[pos:pos + size])
            pos += size

    def _log(self, done: Callable[[torch.Tensor], None], summed: torch.Tensor) -> None:
        if self._held is not None:
            self._held.append((done, summed))  # a checkpoint is being saved: after it
        else:
            done(summed)

    # -- Joinable: what a rank that ran out of data does while the others still train ------
    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _Shadow(self)

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> Any:
        return dist.group.WORLD


class _Shadow(JoinHook):
    """Run on a joined rank once per iteration of the ranks still training (one micro-batch).

    At the micro-batch that ends a step it does what :meth:`StepSync.boundary` does there with
    a zero vote: the same reductions in the same order, learning the others' request and
    cadence. At a log step its (empty) window adds zeros and it logs the result, so rank 0
    shows a row every ``log_every_n_steps`` even after it ran out of data.
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
        sync.boundary(shadowed=self.step)

    def post_hook(self, is_last_joiner: bool) -> None:
        return None


#: the fit's :class:`StepSync`; distrun-join adds it (last) to the Joinables of an epoch
