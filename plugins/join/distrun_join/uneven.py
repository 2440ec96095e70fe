"""Run one epoch whose ranks may hold different numbers of batches.

Two ways, chosen per epoch by :func:`choose_mode`:

- ``join``: torch's ``Join`` context with every ``Joinable`` of the run (the DDP model, a
  ZeroRedundancyOptimizer, anything in ``run.stash[keys.JOINABLES]``). A rank that runs out
  shadows the others' collectives until all are done; then the ranks agree again on the
  parameters (DDP's post-hook), the optimizer and scheduler state, and the step counters.
- ``agree``: the ranks agree on the epoch's length before using a batch (an all-reduce MIN of
  ``len()`` once, or of a have-a-batch flag per batch for iterables without a length), so every
  collective of every step is matched; the batches beyond the smallest rank's count are dropped.

With ``grad_accum > 1`` under Join, each rank's trailing batches that do not fill a whole
accumulation group are dropped (see :class:`WholeGroups`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable

from distrun.plugin import (
    DistrunError,
    Run,
    StashKey,
    keys,
    to_cpu,
)
from distrun_join.options import JoinOptions

__all__ = ["Lockstep", "WholeGroups", "choose_mode", "joinables", "uneven_epoch"]

log = logging.getLogger("distrun")

_ANNOUNCED: StashKey[bool] = StashKey("join.announced")  # the mode was logged once


def joinables(run: Run) -> list[Any]:
    """The run's ``Joinable`` objects: model and optimizer first, then other plugins' ones."""
    found = [obj for obj in (run.model, run.optimizer) if isinstance(obj, Joinable)]
    found += [obj for obj in run.stash.get(keys.JOINABLES, ()) if obj not in found]
    return found


def choose_mode(run: Run) -> str:
    """``join``, ``agree`` or ``off`` for this epoch of ``run``."""
    mode = JoinOptions.of(run.config).join_mode
    if mode == "off" or run.world_size < 2 or not dist.is_initialized():
        return "off"
    if mode == "auto":
        if run.sampler is not None:
            return "off"  # the core's sampler gives every rank the same number of batches
        return "join" if joinables(run) else "agree"
    if mode == "join" and not joinables(run):
        raise DistrunError(
            f"--join-mode join needs a joinable model or optimizer, and strategy "
            f"'{run.strategy.name}' has none (use --join-mode agree, or --strategy ddp)")
    return mode


@contextlib.contextmanager
def uneven_epoch(run: Run, epoch: int) -> Iterator[None]:
    """Around the core's epoch: Join, lockstep batches, or nothing (see :func:`choose_mode`)."""
    mode = choose_mode(run)
    if mode == "join":
        with _joined(run, epoch):
            yield
    elif mode == "agree":
        loader = run.train_loader
        run.train_loader = Lockstep(loader, run.strategy)
        try:
            yield
        finally:
            run.train_loader = loader
    else:
        yield


@contextlib.contextmanager
def _joined(run: Run, epoch: int) -> Iterator[None]:
    cfg = run.config
    opts = JoinOptions.of(cfg)
    found = joinables(run)
    if not run.stash.get(_ANNOUNCED):
        run.stash[_ANNOUNCED] = True
        log.info("join: epochs run inside torch's Join with %s; in-epoch validation waits for "
                 "the end of each epoch", ", ".join(type(j).__name__ for j in found))
    # The loop's own step-boundary collectives (stop vote, metric reduction) go last: a rank
    # that joined shadows them after the model's and optimizer's.
    sync = run.stash.get(keys.STEP_SYNC)
    join = Join([*found, *([sync] if sync is not None else [])],
                throw_on_early_termination=opts.join_throw_on_early_termination,
                divide_by_initial_world_size=opts.join_divide_by_initial_world_size)
    loader = run.train_loader
    if cfg.grad_accum > 1:
        run.train_loader = WholeGroups(loader, cfg.grad_accum)
    body_done = False
    run.stash[keys.UNEVEN_EPOCH] = True
    try:
        with join:
            yield
            body_done = True
    except RuntimeError as exc:
        # Told by where it came from, not its text: torch's Join raises early termination from
        # its own frames, on a rank still training (inside the body, from notify_join_context)
        # or on the rank that ran out (after the body, from Join.__exit__).
        if opts.join_throw_on_early_termination and _from_join(exc):
            who = "this rank" if body_done else "another rank"
            raise DistrunError(
                f"rank {run.rank}: {who} ran out of batches in epoch {epoch} at step "
                f"{run.progress.step} while other ranks had more, and "
                "join_throw_on_early_termination is on (turn it off to let ranks join, or "
                "give every rank the same number of batches)") from exc
        raise
    finally:
        run.stash[keys.UNEVEN_EPOCH] = False
        run.train_loader = loader
    _resync(run, found)


def _from_join(exc: BaseException) -> bool:
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_globals.get("__name__") == Join.__module__


def _resync(run: Run, found: list[Any]) -> None:
    """After Join: step counters to the group's, optimizer/scheduler state from the last joiner."""
    device = run.strategy.device
    steps = torch.zeros(run.world_size, 2, dtype=torch.int64, device=device)
    steps[run.rank, 0] = run.progress.step
    steps[run.rank, 1] = run.progress.micro_step
    dist.all_reduce(steps)
    last = int(torch.argmax(steps[:, 1]).item())  # the rank that trained longest
    run.progress.step = int(steps[last, 0])
    run.progress.micro_step = int(steps[last, 1])
    if steps[:, 1].min() == steps[:, 1].max():
        return
    states: list[Any] = [None, None]
    if run.rank == last:
        optim_sd = None if run.optimizer in found or run.optimizer is None \
            else to_cpu(run.optimizer.state_dict())
        states = [optim_sd, run.scheduler_states()]
    dist.broadcast_object_list(states, src=last)
    if run.rank != last:
        if states[0] is not None:
            run.optimizer.load_state_dict(states[0])
        run.load_scheduler_states(states[1])


class WholeGroups:
    """Only whole accumulation groups of ``data``: a rank's trailing partial group is dropped.

    Under Join, ranks still training must all-reduce at the same micro-steps; a partial last
    group would make its rank all-reduce where the others skip (``no_sync``).
    """

    def __init__(self, data: Iterable[Any], size: int) -> None:
        self.data = data
        self.size = size

    def __iter__(self) -> Iterator[Any]:
        group: list[Any] = []
        for batch in self.data:
            group.append(batch)
            if len(group) == self.size:
                yield from group
                group = []


class Lockstep:
    """An iterable that stops on every rank as soon as one rank's ``data`` is exhausted."""

    def __init__(self, data: Iterable[Any], strategy: Any) -> None:
        self.data = data
        self.strategy = strategy

    def _min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.strategy.device)
        self.strategy.all_reduce(t, "min")
        return int(t.item())

    def __iter__(self) -> Iterator[Any]:
        try:
            n = len(self.data)  # type: ignore[arg-type]
        except TypeError:
            n = None
        # Whether lengths are known must be agreed too, or the ranks' collectives differ.
        if self._min(0 if n is None else 1) == 1:
            yield from itertools.islice(self.data, self._min(n))  # type: ignore[arg-type]
            return
        it = iter(self.data)
        while True:
            try:
                batch, have = next(it), 1
            except StopIteration:
                batch, have = None, 0
            if self._min(have) == 0:
                return
            yield batch
