"""The workers' loop under ``--ft``: one quorum per step, the global batch split by quorum.

Every step: torchft's Manager forms the quorum (synchronously, so a group that must heal has
loaded a live peer's state before its forward pass), the fixed global batch (``--batch-size``
samples, in the order of ``(seed, epoch)``) is split among the live groups by replica rank
and then among a group's ranks, the group's strategy averages the gradients inside the group
(ddp: each rank holds the whole gradient; fsdp: each rank its shard, reduce-scattered), the
Manager averages what each rank holds with the same rank of every other group, and the optimizer steps only when every
participant votes to commit. A step that does not commit (a peer died in it) is tried again
with the next quorum, on the same samples: each sample of the data order is consumed by
exactly one committed step.

The loss of each rank is scaled so that the committed gradient is the mean over the whole
global batch whatever the number of live groups: the effective batch and the learning rate
do not change when a group drops (each live group takes a larger share of the same batch).

With ``--ft-sync localsgd:N`` or ``diloco:N`` the groups meet every N steps instead
(:mod:`distrun_ft.sync`).

State a healing group takes from its peer: the model's and the optimizer's state dicts, the
run's progress (step, epoch, samples) and torchft's own step; the data cursor is the committed
step itself.

A restarted group (the launcher starts it with ``--resume auto``: it has loaded the run's newest
checkpoint) waits for a live peer to heal from and neither trains nor saves until then. When no
group is live any more (every group died; the launcher says so with an ``alone`` mark in the
meeting folder) nobody can heal it: it loads the run's newest checkpoint once more (one a peer
committed after this group started) and trains on from there; replacements that meet in one
quorum take the newest state among them (torchft heals the others from it). How a group meets
the others (torchft's Manager, the launcher's meeting folder and its marks, a stop agreed
inside the group) is :mod:`distrun_ft.replicas`.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from distrun.plugin import (
    StashKey,
    UsageError,
    epoch_permutation,
    first_line,
)
from distrun_ft.launcher import (
    ATTEMPT_ENV,
    GROUPS_ENV,
    REPLICA_ENV,
    mark_name,
)
from distrun_ft.replicas import (
    _agreed,
    _make_manager,
    _mark,
    _marked,
    _meet,
    _refuse_a_foreign_quorum,
    _resume_alone,
    _serve_group_store,
    _stop_agreed,
)
from distrun_ft.settings import sync_mode, timeouts
from distrun_ft.sync import Window

__all__ = ["FT", "FtState", "fit_ft", "is_saver", "share"]


@dataclass
class FtState:
    """What the loop knows of the current step's quorum (``run.stash[FT]``)."""

    manager: Any
    replica: int
    replica_rank: int = 0
    participants: int = 1
    quorum_id: int = -1
    #: False while a restarted group waits for a peer: it holds no state of the run's yet
    joined: bool = True
    #: the slow-rank checks (run.compute_times): this group's ranks, compared in its log
    #: reduction; this rank against its counterparts in the other groups, in the all-reduce
    #: across them (None: one rank, one group)
    ranks: Any = None
    groups: Any = None


FT: StashKey[FtState] = StashKey("ft.state")


def share(total: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of part ``index`` when ``total`` items split into ``parts`` near-equal
    contiguous parts (the first ``total % parts`` get one more)."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def is_saver(run: Any) -> bool:
    """True in the group that writes durable checkpoints: the lowest live replica rank (a
    restarted group that has not healed yet never saves)."""
    state = run.stash.get(FT)
    return state is None or (state.joined and state.replica_rank == 0)


def _dataset(run: Any) -> Any:
    loader = run.train_loader
    data = getattr(loader, "dataset", None)
    if data is None or isinstance(data, torch.utils.data.IterableDataset) or \
            not hasattr(data, "__getitem__") or not hasattr(data, "__len__"):
        raise UsageError("--ft needs train_data() to return a map-style Dataset (with "
                         "__len__ and __getitem__): the live groups split each global batch "
                         "by index")
    return data


def _local_grads(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Each parameter's gradient as this rank holds it: the whole gradient under ddp, this
    rank's shard (a DTensor's local tensor, a view of it) under fsdp. Rank r of a group
    syncs with rank r of every other group, which holds the same shard."""
    out = []
    with torch.no_grad():
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grad = p.grad
            out.append(grad.to_local() if hasattr(grad, "to_local") else grad)
    return out


def _flat(grads: list[torch.Tensor], tail: torch.Tensor | None = None) -> torch.Tensor:
    """The tensors in one, for one all-reduce; ``tail`` after them."""
    return torch.cat([g.reshape(-1) for g in grads] + ([tail] if tail is not None else []))


def _times(state: FtState, step: int, like: list[torch.Tensor]) -> torch.Tensor | None:
    """This rank's compute times per step to carry in the all-reduce across the groups that
    ends step ``step`` (None: one group), as the tensors ``like``."""
    if state.groups is None or not like:
        return None
    return torch.tensor(state.groups.pack(step), dtype=like[0].dtype, device=like[0].device)


def _judge_groups(run: Any, state: FtState, carried: torch.Tensor) -> None:
    """After a committed all-reduce across the groups: the compute times it carried at its
    end (a mean over the participants, so times them is the sum) judged; a group's
    straggler is said by the lowest live group's rank."""
    if state.groups is None or carried.numel() < state.groups.size:
        return
    tail = carried[carried.numel() - state.groups.size:]
    said = state.groups.add((tail.double() * state.participants).tolist())
    if said and state.replica_rank == 0:
        run.log.warning("warning: %s", said)


def _unflatten(grads: list[torch.Tensor], flat: torch.Tensor) -> None:
    at = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[at:at + n].view_as(g))
        at += n


def fit_ft(run: Any) -> Any:
    """The ``distrun_run_fit`` of an ``--ft`` worker; returns ``run.progress``."""
    cfg = run.config
    data = _dataset(run)
    collate = getattr(run.task, "collate_fn", None) or torch.utils.data.default_collate
    batch = int(cfg.batch_size)
    per_epoch = len(data) // batch
    if per_epoch == 0:
        raise UsageError(f"the dataset has {len(data)} samples, fewer than --batch-size {batch}")
    total = int(cfg.max_epochs) * per_epoch
    if int(cfg.max_steps) > 0:
        total = min(total, int(cfg.max_steps))
    replica = int(os.environ.get(REPLICA_ENV, "0"))
    inner_rank, inner_world = run.strategy.dp_rank, run.strategy.dp_world_size
    own_group = not dist.is_initialized()
    served = None  # the group's store, served while the fit runs
    if own_group:
        # A one-rank group (the strategy made no process group): the Manager still needs the
        # group's store, which rank 0 serves on the launcher's socket once a group forms.
        dist.init_process_group("gloo", timeout=timedelta(seconds=float(cfg.timeout)))
    elif dist.get_world_size() == 1:
        served = _serve_group_store()
    if not cfg.debug:
        # torchft logs each peer failure with a traceback; the loop says it in one line
        logging.getLogger("torchft").setLevel(logging.CRITICAL)
    mode, every = sync_mode(cfg)
    window = Window(run, mode, every) if mode != "step" else None
    manager = _make_manager(run, replica, window)
    state = run.stash[FT] = FtState(manager, replica)
    if run.world_size > 1:
        state.ranks = run.compute_times()
    if int(os.environ.get(GROUPS_ENV, "1")) > 1:
        state.groups = run.compute_times(
            int(os.environ[GROUPS_ENV]), replica,
            name=lambda g: f"replica group {g}" + (f" (its rank {run.rank})"
                                                   if run.world_size > 1 else ""))
    _meet(run, replica, timeouts(cfg).quorum)
    if run.progress.step:  # torchft's step counts committed syncs
        manager.load_state_dict({"step": run.progress.step // every, "batches_committed": 0})
    params = [p for p in run.model.parameters() if p.requires_grad]
    orders: dict[int, torch.Tensor] = {}
    # A restarted group waits for a live peer to heal from: alone, it would train the run
    # again from its start (or its newest checkpoint) while the others are ahead or done.
    attempt = os.environ.get(ATTEMPT_ENV, "0")
    replacement = int(attempt) > 0 and int(os.environ.get(GROUPS_ENV, "1")) > 1
    state.joined = not replacement
    validated_at = -1
    stopped = False
    try:
        while run.progress.step < total and not run.done:
            stopped = _stop_agreed(run)
            if stopped:
                break
            run.mark("quorum")  # (a wait for the other groups: never this group's stall)
            manager.start_quorum()
            _refuse_a_foreign_quorum(run, manager, replica)
            state.replica_rank = manager.participating_rank() or 0
            state.participants = max(1, manager.num_participants())
            state.quorum_id = int(getattr(manager, "_quorum_id", -1))
            if replacement:
                if state.participants == 1:
                    # alone: a peer may still be live (wait to heal from it), unless the
                    # launcher said none is (then this group goes on from the checkpoint)
                    if not _agreed(run.strategy.rank == 0 and
                                   _marked(mark_name("alone", replica, attempt))):
                        time.sleep(0.05)
                        continue
                    _resume_alone(run, manager, every)
                replacement = False
                state.joined = True
                _mark(mark_name("joined", replica, attempt))
                if state.participants == 1:
                    continue  # a quorum at the step just loaded
            step = run.progress.step  # after a heal: the peers' step

            def samples(at: int) -> tuple[list[int], int]:
                """This rank's sample ids of step ``at`` (0-based), and their epoch."""
                epoch, within = divmod(at, per_epoch)
                if epoch not in orders:
                    orders.clear()
                    orders[epoch] = epoch_permutation(int(cfg.seed), epoch, len(data))
                ids = orders[epoch][within * batch:(within + 1) * batch]
                lo, hi = share(batch, state.participants, state.replica_rank)
                a, b = share(hi - lo, inner_world, inner_rank)
                return ids[lo + a:lo + b].tolist(), epoch

            if window is not None:
                _train_window(run, manager, window, state, samples, collate, data, total,
                              per_epoch, replica)
                continue
            mine, epoch = samples(step)
            run.progress.epoch = epoch
            run.optimizer.zero_grad(set_to_none=True)
            run.mark("forward")
            out = run.hook.distrun_training_step(run=run, batch=collate([data[i] for i in mine]))
            loss = out["loss"] if isinstance(out, dict) else out
            # the group's mean (ddp), then the groups' mean (torchft): the global batch's mean
            scale = len(mine) * inner_world * state.participants / batch
            run.mark("backward")
            run.hook.distrun_backward(run=run, loss=loss * scale)
            grads = _local_grads(params)
            flat = _flat(grads, _times(state, step + 1, grads))
            manager.allreduce(flat).wait()
            _unflatten(grads, flat)
            if not manager.should_commit():
                if run.strategy.rank == 0:
                    why = manager.errored()
                    run.log.warning(
                        "replica group %d: step %d not committed (%s); trying it again with "
                        "the next quorum", replica, step + 1,
                        first_line(why.original_exception) if why is not None
                        else "a peer did not commit")
                continue  # the same samples again, with the next quorum
            _judge_groups(run, state, flat)
            run.mark("optimizer")
            run.hook.distrun_optimizer_step(run=run)
            run.progress.step = step + 1
            run.mark("boundary", step=run.progress.step)
            run.progress.samples += batch
            metrics = {"loss": loss.detach(), "ft_participants": state.participants,
                       "ft_quorum_id": state.quorum_id, "ft_replica_rank": state.replica_rank}
            run.hook.distrun_on_step_end(run=run, step=run.progress.step, metrics=metrics)
            if run.progress.step % int(cfg.log_every_n_steps) == 0 or \
                    run.progress.step == total:
                _log(run, loss, state)
            epoch_ended = run.progress.step % per_epoch == 0
            if epoch_ended or _validation_due(run, step):
                _validate(run)
                validated_at = run.progress.step
            if epoch_ended:
                run.hook.distrun_on_epoch_end(run=run, epoch=epoch)
            if run.stop_requested:  # (a stop signal: agreed at the next step's start)
                run.done = True
        if not stopped:  # a signal during the last step: every rank of the group knows it
            _stop_agreed(run)
        if run.stop_signal is None:  # trained to the end, or stopped early by the task
            if window is None and validated_at != run.progress.step and \
                    run.progress.step % per_epoch:
                _validate(run)  # the last, partial epoch (as the core's loop does)
            # a failure from here on is the script's, not a lost group
            _mark(mark_name("fitted", replica, attempt))
    finally:
        manager.shutdown(wait=False)
        if own_group:
            dist.destroy_process_group()
        del served
    return run.progress


def _train_window(run: Any, manager: Any, window: Window, state: FtState, samples: Any,
                  collate: Any, data: Any, total: int, per_epoch: int, replica: int) -> None:
    """One window of ``--ft-sync``: up to N local steps, then the sync (see distrun_ft.sync)."""
    batch = int(run.config.batch_size)
    inner_world = run.strategy.dp_world_size
    start = run.progress.step
    steps = min(window.every, total - start)
    window.begin()
    loss = torch.zeros(())
    for at in range(start, start + steps):
        mine, epoch = samples(at)
        run.progress.epoch = epoch
        run.optimizer.zero_grad(set_to_none=True)
        run.mark("forward")
        out = run.hook.distrun_training_step(run=run, batch=collate([data[i] for i in mine]))
        loss = out["loss"] if isinstance(out, dict) else out
        # the mean over this group's share of the global batch (its strategy averages ranks)
        lo, hi = share(batch, state.participants, state.replica_rank)
        run.mark("backward")
        run.hook.distrun_backward(run=run, loss=loss * (len(mine) * inner_world / (hi - lo)))
        run.mark("optimizer")
        run.hook.distrun_optimizer_step(run=run)
        run.progress.step = at + 1
        run.mark("boundary", step=run.progress.step)
    run.mark("quorum")
    if not window.sync(manager, _times(state, start + steps, window.params)):
        window.rewind()
        if run.strategy.rank == 0:
            why = manager.errored()
            run.log.warning("replica group %d: steps %d-%d not committed (%s); training them "
                            "again with the next quorum", replica, start + 1, start + steps,
                            first_line(why.original_exception) if why is not None
                            else "a peer did not commit")
        return
    _judge_groups(run, state, window.tail)
    run.progress.samples += batch * steps
    metrics = {"loss": loss.detach(), "ft_participants": state.participants,
               "ft_quorum_id": state.quorum_id, "ft_replica_rank": state.replica_rank}
    run.hook.distrun_on_step_end(run=run, step=run.progress.step, metrics=metrics)
    _log(run, loss, state)
    ended = range(start // per_epoch, run.progress.step // per_epoch)
    if ended or _validation_due(run, start):
        _validate(run)
    for epoch in ended:
        run.hook.distrun_on_epoch_end(run=run, epoch=epoch)
    if run.stop_requested:  # (a stop signal: agreed at the next window's start)
        run.done = True


def _validation_due(run: Any, start: int) -> bool:
    """Whether ``--val-every-n-steps`` asks for a validation between step ``start`` and the
    step just committed (one step, or a window of ``--ft-sync``)."""
    every = int(run.config.val_every_n_steps)
    return every > 0 and start // every < run.progress.step // every


def _validate(run: Any) -> None:
    """A validation (each epoch's end, and every ``--val-every-n-steps`` steps; once where
    both fall on one step), as the core's loop runs it: through ``distrun_run_validation``
    over this group's ranks (every group gets the same figures: their weights are the same),
    then logged and handed to ``distrun_on_validation_end``."""
    if run.val_loader is None:
        return
    metrics = run.hook.distrun_run_validation(run=run) or {}
    run.model.train()
    if metrics:
        run.metrics.update(metrics)
        run.hook.distrun_on_validation_end(run=run, step=run.progress.step, metrics=metrics)
        run.hook.distrun_log_metrics(run=run, step=run.progress.step, metrics=dict(metrics))


def _log(run: Any, loss: torch.Tensor, state: FtState) -> None:
    value = loss.detach().to(torch.float64).reshape(1).clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        # the group's ranks' compute times ride in the loss's reduction
        times = state.ranks.pack(run.progress.step) if state.ranks is not None else []
        value = torch.cat([value, torch.tensor(times, dtype=torch.float64,
                                               device=value.device)])
        dist.all_reduce(value)
        if state.ranks is not None:
            said = state.ranks.add(value[1:].tolist())
            if said and run.rank == 0:
                run.log.warning("warning: replica group %d: %s", state.replica, said)
        value = value[:1] / dist.get_world_size()
    metrics = {"loss": float(value), "epoch": float(run.progress.epoch),
               "ft_participants": float(state.participants),
               "ft_quorum_id": float(state.quorum_id),
               "ft_replica_rank": float(state.replica_rank)}
    # the compute times per step (run.compute_times): the group's ranks' as distrun's loop
    # logs them, and the groups' (this rank's counterparts in them)
    for spread, who, of in ((_spread(state.ranks), "rank", ""),
                            (_spread(state.groups), "group", "_group")):
        if spread is not None:
            metrics.update({f"slowest_{who}": float(spread.slowest_rank),
                            f"slowest{of}_compute_ms": spread.slowest * 1e3,
                            f"fastest{of}_compute_ms": spread.fastest * 1e3})
    run.metrics.update(metrics)
    run.hook.distrun_log_metrics(run=run, step=run.progress.step, metrics=metrics)


def _spread(times: Any) -> Any:
    return times.spread if times is not None else None
