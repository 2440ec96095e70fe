"""The core's own loop: setup, fit, epoch, step, validation. Plugins wrap these via hooks.

What the setup hooks build is :mod:`distrun._train.build`; what the steps log between two log
rows, and its packing for the ranks' reduction, is :mod:`distrun._train.log_window`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import signal
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, cast

import pluggy
import torch

from distrun._diagnose.position import Phase, marks
from distrun._registry.collect import choose_strategy, collect_strategies
from distrun._spec.errors import DistrunError, UsageError
from distrun._spec.keys import COMPILE_TIME, UNEVEN_EPOCH
from distrun._spec.stash import StashKey
from distrun._train import models
from distrun._train.build import STREAM, _describe
from distrun._train.limits import set_deterministic
from distrun._train.log_window import _WINDOW, _pack_window, _Window
from distrun._train.metric_objects import place_metrics
from distrun._train.metrics import Accumulator, LogTarget, logging_to
from distrun._train.optimizers import is_manual
from distrun._train.rng import seed_everything
from distrun._train.run import Run
from distrun._train.schedulers import normalize_schedulers, step_schedulers
from distrun._train.skip_init import build_model
from distrun._train.step_sync import NONE, PREEMPT, STEP_SYNC, StepSync
from distrun._train.tensors import batch_len, to_device

__all__ = ["fit_loop", "setup_run"]

log = logging.getLogger("distrun")


def setup_run(run: Run) -> None:
    """Strategy, model, optimizer and data, each through its hook."""
    info = choose_strategy(run.config, run.world_size, collect_strategies(run.pm),
                           run.pm.is_blocked)
    run.strategy = info.build(run.config)
    if not run.strategy.trains:  # (it serves in its setup; never behind: it takes no steps)
        marks().phase(Phase.SERVING)
    run.strategy.setup(run)
    run.hook.distrun_setup_strategy(run=run)
    if not run.strategy.trains:
        return  # a serving rank (RPC parameter server): nothing to build here
    set_deterministic(run)
    seed_everything(run.config.seed)
    run.model = build_model(run)  # configure_model(), uninitialized before a load
    if not isinstance(run.model, torch.nn.Module):
        raise UsageError("task.configure_model() must return a torch.nn.Module")
    place_metrics(run.task, run.strategy.device)  # the task's metric objects, as the model
    run.hook.distrun_setup_model(run=run)
    run.hook.distrun_setup_optimizer(run=run)
    run.hook.distrun_setup_data(run=run)
    # what the task (or a plugin) set as run.lr_scheduler: one, a dict or a list of them
    run.schedulers = normalize_schedulers(run.lr_scheduler)
    run.lr_scheduler = run.schedulers[0].scheduler if run.schedulers else None


# -- the loop ------------------------------------------------------------------------------


def _with_last(items: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    it = iter(items)
    try:
        prev = next(it)
    except StopIteration:
        return
    for item in it:
        yield prev, False
        prev = item
    yield prev, True


# the loop's own slots on the run (the log window's: log_window._WINDOW)
#: what the steps log per epoch (``on_epoch``), reduced and logged at each epoch's end
_EPOCH_LOGGED: StashKey[Accumulator] = StashKey("loop.epoch_logged")
_VALIDATED_AT: StashKey[int] = StashKey("loop.validated_at_step")
#: a client of the rendezvous store, where ranks of plain iterables meet at an epoch's end
_RENDEZVOUS_STORE: StashKey[Any] = StashKey("loop.rendezvous_store")


def fit_loop(run: Run) -> Any:
    """The core's ``distrun_run_fit``: epochs until max_epochs/max_steps or a stop."""
    run.stash[_WINDOW] = _Window(run.stash.get(COMPILE_TIME))
    run.stash[_EPOCH_LOGGED] = Accumulator()
    sync = run.stash[STEP_SYNC] = StepSync(run, functools.partial(_pack_window, run))
    run.progress.step_started = time.monotonic()
    if run.sampler is not None:
        run.sampler.epoch = run.progress.epoch
    _set_stream_epoch(run)
    rec = marks()
    rec.in_loop = True  # (a plain script's step marks stay quiet meanwhile)
    try:
        return _fit_epochs(run, sync)
    finally:
        rec.in_loop = False


def _fit_epochs(run: Run, sync: StepSync) -> Any:
    """The epochs of :func:`fit_loop`, then the last validation."""
    cfg = run.config
    while run.progress.epoch < cfg.max_epochs and not run.done:
        run.hook.distrun_run_epoch(run=run, epoch=run.progress.epoch)
        _await_ranks(run, run.progress.epoch)
        if _stop_agreed(run, sync.drain()) == PREEMPT:
            break
        finished = run.progress.epoch
        _log_epoch_values(run)
        if not run.done or _epoch_complete(run):
            if run.val_loader is not None and run.stash.get(_VALIDATED_AT) != run.progress.step:
                validate(run)  # (unless val_every_n_steps just did, at this step)
            run.progress.epoch += 1
            run.progress.batch_idx = 0
            if run.schedulers and not is_manual(run.task):  # (manual: the task steps them)
                step_schedulers(run.schedulers, "epoch", run.progress.epoch, run.metrics)
            if run.sampler is not None:
                run.sampler.set_epoch(run.progress.epoch)
            _next_stream_epoch(run)
            run.hook.distrun_on_epoch_end(run=run, epoch=finished)
            if not run.done and run.stop_requested:
                # asked at the epoch's validation (early stopping): agreed before the next
                _stop_agreed(run, sync.drain())
    _stop_agreed(run, sync.drain(metrics=True))  # and logs the last, partial window
    stopped = run.stop_signal is not None
    if not stopped and run.val_loader is not None \
            and run.stash.get(_VALIDATED_AT) != run.progress.step:
        validate(run)
    return run.progress


def _next_stream_epoch(run: Run) -> None:
    """A stream starts the next epoch from its beginning (a checkpoint now must not hold the
    finished epoch's end), reshuffled when it can be."""
    cursor = run.stash.get(STREAM)
    if cursor is not None:
        cursor.state = None
        _set_stream_epoch(run)


def _set_stream_epoch(run: Run) -> None:
    stream: Any = getattr(run.train_loader, "dataset", None)
    if run.stash.get(STREAM) is not None and hasattr(stream, "set_epoch"):
        stream.set_epoch(run.progress.epoch)


def _log_epoch_values(run: Run) -> None:
    """Reduce what the steps logged ``on_epoch`` this epoch and log it (every rank is at the
    epoch's end here, joined ones included)."""
    acc = run.stash[_EPOCH_LOGGED]
    metrics = acc.reduce(run.strategy) if acc else {}
    if metrics:
        metrics["epoch"] = float(run.progress.epoch)
        run.metrics.update(metrics)
        run.hook.distrun_log_metrics(run=run, step=run.progress.step, metrics=metrics)


_NONFINITE_SEEN: StashKey[bool] = StashKey("loop.nonfinite_seen")


def _check_loss(run: Run, loss: Any, epoch: int) -> None:
    """The loss must be a tensor; a non-finite one is said once (or stops the run)."""
    if not isinstance(loss, torch.Tensor):
        raise UsageError(
            f"{type(run.task).__name__}.training_step(model, batch) returned {_describe(loss)}; "
            "it must return the loss as a torch.Tensor (e.g. `return F.mse_loss(model(x), y)`)")
    policy = run.config.nonfinite_loss
    if policy == "ignore" or (policy == "warn" and run.stash.get(_NONFINITE_SEEN)):
        return
    # one scalar read per micro-step (a host sync on an accelerator; ~1 us on CPU)
    value = loss.item() if loss.numel() == 1 else float(loss.detach().float().sum())
    if math.isfinite(value):
        return
    step = run.progress.step + 1
    if policy == "stop":
        raise DistrunError(f"rank {run.rank}: the loss is {value} at step {step} (epoch "
                           f"{epoch}); stopped there as --nonfinite-loss stop asks")
    run.stash[_NONFINITE_SEEN] = True
    log.warning("warning: the loss is %s at step %d (epoch %d); training goes on "
                "(said once; --nonfinite-loss stop ends the run at such a step)", value, step,
                epoch)


def _loss_of(run: Run, out: Mapping[str, Any], target: LogTarget) -> Any:
    """The loss of a dict a training step returned; its other keys are logged."""
    if "loss" not in out:
        raise UsageError(
            f"{type(run.task).__name__}.training_step(model, batch) returned a dict without "
            f"'loss' (keys {', '.join(map(repr, list(out)[:5]))}); put the loss to "
            "back-propagate under 'loss' (the other keys are logged)")
    target.add_many(out, skip="loss")
    return out["loss"]


def _stop_agreed(run: Run, agreed: int) -> int:
    """Act on what the ranks agreed: a preemption as if this rank had the signal itself."""
    if agreed == PREEMPT and run.stop_signal is None:
        run.stop_signal = int(signal.SIGTERM)
    if agreed != NONE:
        run.done = True
    return agreed


def _await_ranks(run: Run, epoch: int) -> None:
    """Plain iterables may run out at different steps on different ranks: meet at the end of
    the epoch through the store, not a collective (a rank still training would mismatch it and
    gloo aborts), so a rank ahead fails with a timeout instead of corrupting the next op."""
    import datetime
    import os

    import torch.distributed as dist

    if run.sampler is not None or run.world_size < 2 or not dist.is_initialized() \
            or dist.get_world_size() != run.world_size:
        return
    store = run.stash.get(_RENDEZVOUS_STORE)
    if store is None:
        if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
            # A client of the store torchrun's environment names (rank 0's, or the elastic
            # agent's): the one the group rendezvoused on. torch has no public getter of the
            # default group's store; a connection of our own is public API, made once a run.
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  is_master=False,
                                  timeout=datetime.timedelta(seconds=run.config.timeout))
        else:
            # a group the user made without torchrun's variables (init_method="tcp://...",
            # "file://..."): only torch's own handle reaches its store
            store = dist.distributed_c10d._get_default_store()
        run.stash[_RENDEZVOUS_STORE] = store
    key = f"distrun/epoch_end/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{epoch}"
    arrived = store.add(key, 1)  # counts on across fits that share one process group
    done = f"{key}/{(arrived - 1) // run.world_size}"
    if arrived % run.world_size == 0:
        store.set(done, "1")
    try:
        store.wait([done], datetime.timedelta(seconds=run.config.timeout))
    except RuntimeError:
        raise TimeoutError(f"rank {run.rank} finished epoch {epoch} but the other ranks did "
                           f"not within the {run.config.timeout:g}s timeout") from None


def _epoch_complete(run: Run) -> bool:
    return run.sampler is not None and len(run.sampler) == 0


def epoch_loop(run: Run, epoch: int) -> int:
    """The core's ``distrun_run_epoch``: micro-batches with accumulation, steps, logging."""
    cfg, st, hook = run.config, run.strategy, run.hook
    model, window, sync = run.model, run.stash[_WINDOW], run.stash[STEP_SYNC]
    # Under Join a rank that ran out of data cannot shadow a validation pass: the in-epoch
    # ones wait for the end of the epoch, when every rank is back in step.
    val_every = 0 if run.stash.get(UNEVEN_EPOCH) else cfg.val_every_n_steps
    accum = cfg.grad_accum
    local_batch = run.sampler.local_batch if run.sampler is not None else None
    training_step = _direct(hook.distrun_training_step, ("run", "batch"))
    backward = _direct(hook.distrun_backward, ("run", "loss"))
    optimizer_step = _direct(hook.distrun_optimizer_step, ("run",))
    step_end = _direct(hook.distrun_on_step_end, ("run", "step", "metrics"))
    per_step = [s for s in run.schedulers if s.interval == "step"]
    # the common case, one plain per-step scheduler: call its step() directly
    sched_step = per_step[0].scheduler.step if len(per_step) == 1 and per_step[0].frequency == 1 \
        and not per_step[0].plateau else None
    target, batches = epoch_start(run, epoch, model)
    rec = marks()
    mark = rec.phase
    with logging_to(target):
        micro_in_step = 0
        for batch, last in batches:
            batch = to_device(batch, st.device)
            micro_in_step += 1
            boundary = micro_in_step == accum or last
            ctx = models.no_sync(st, model) if not boundary else _NULL
            with ctx:
                mark(Phase.FORWARD)
                loss = training_step(run=run, batch=batch)
                if not isinstance(loss, torch.Tensor) and isinstance(loss, Mapping):
                    loss = _loss_of(run, loss, target)  # {"loss": ..., values to log}
                _check_loss(run, loss, epoch)
                mark(Phase.BACKWARD)
                backward(run=run, loss=loss / accum if accum > 1 else loss)
            if run.sampler is not None:
                run.sampler.advance()
            run.progress.micro_step += 1
            run.progress.batch_idx += 1
            window.add_loss(loss)
            window.micro += 1
            window.samples += local_batch if local_batch is not None else batch_len(batch)
            if not boundary:
                continue
            micro_in_step = 0
            mark(Phase.OPTIMIZER)
            optimizer_step(run=run)
            run.optimizer.zero_grad(set_to_none=True)
            prog = run.progress
            if sched_step is not None:
                sched_step()
            elif per_step:
                step_schedulers(per_step, "step", prog.step + 1, run.metrics)
            prog.step += 1
            prog.step_started = time.monotonic()
            rec.step_done(prog.step)
            if step_end is not _nothing:
                step_end(run=run, step=prog.step, metrics={"loss": loss.detach(), "epoch": epoch})
            if step_boundary(run, sync, val_every, model):
                break
    return epoch + 1


def epoch_start(run: Run, epoch: int, model: torch.nn.Module) -> tuple[LogTarget, Any]:
    """Before an epoch's batches (both epoch loops): the log window's epoch, the fit's log
    target, and the batches, each with a flag for the epoch's last one."""
    run.stash[_WINDOW].epoch = epoch
    target = LogTarget("fit", run.stash[_WINDOW].logged, run.stash[_EPOCH_LOGGED])
    cursor = run.stash.get(STREAM)
    batches = cursor.with_last() if cursor is not None else _with_last(run.train_loader)
    model.train()
    return target, _fetching(iter(batches), marks().phase)


def _fetching(batches: Iterator[Any], mark: Callable[[Phase], None]) -> Iterator[Any]:
    """``batches``, the rank's position marked as loading data while each is fetched, and
    at its epoch's end once there are none."""
    while True:
        mark(Phase.DATA)
        try:
            item = next(batches)
        except StopIteration:
            mark(Phase.EPOCH_END)
            return
        yield item


def step_boundary(run: Run, sync: Any, val_every: int, model: torch.nn.Module) -> bool:
    """After an optimizer step (both epoch loops): the agreed stop (at log steps also the
    metrics' reduction and logging), the validation cadence, ``max_steps``. True: stop."""
    marks().phase(Phase.BOUNDARY)
    _stop_agreed(run, sync.boundary())
    if val_every and run.progress.step % val_every == 0 and run.val_loader is not None:
        validate(run)
        model.train()
    if 0 <= run.config.max_steps <= run.progress.step:
        run.done = True
    return run.done


def _direct(caller: pluggy.HookCaller, argnames: tuple[str, ...]) -> Callable[..., Any]:
    """What to call for a per-step hook the loop calls with the keywords ``argnames``: when a
    single plain implementation answers it that takes exactly those (the core's, for a run
    without mixed precision or loss-parallel TP), that function itself; otherwise the hook.

    Why skip pluggy: its dispatch costs ~3 us a call against ~0.1 us for the function (pluggy
    1.7, this machine), four calls a step, a few percent of a tiny model's step. Only
    pluggy's public API is read (``get_hookimpls`` and ``HookImpl``'s documented attributes).
    Resolved once per epoch: plugins add per-step hooks at setup or at the start of the fit
    (``run.add_hooks``)."""
    impls = caller.get_hookimpls()
    if not impls:
        return _nothing
    only = impls[0]
    if len(impls) == 1 and not (only.wrapper or only.hookwrapper) \
            and tuple(only.argnames) == argnames:
        return cast(Callable[..., Any], only.function)
    return cast(Callable[..., Any], caller)


def _nothing(**kwargs: Any) -> None:
    return None


#: the context of a micro-batch that syncs (one shared instance: nullcontext is reentrant)
_NULL = contextlib.nullcontext()


def validate(run: Run) -> Mapping[str, float]:
    sync = run.stash.get(STEP_SYNC)
    if sync is not None:
        sync.flush()  # the training row of this step is logged before the validation row
    started = time.perf_counter()
    window = run.stash.get(_WINDOW)
    compiled = window.clock.seconds if window is not None and window.clock is not None else 0.0
    metrics = run.hook.distrun_run_validation(run=run) or {}
    if window is not None:  # samples/s counts training time only
        window.started += time.perf_counter() - started
        if window.clock is not None:
            window.compiled_in_validation += window.clock.seconds - compiled
            window.clock.mark_step()  # the next step starts after the validation
    run.stash[_VALIDATED_AT] = run.progress.step
    if metrics:
        run.metrics.update(metrics)
        run.hook.distrun_on_validation_end(run=run, step=run.progress.step, metrics=metrics)
        run.hook.distrun_log_metrics(run=run, step=run.progress.step, metrics=dict(metrics))
    return metrics
