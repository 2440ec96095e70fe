"""The core's own loop: setup, fit, epoch, step, validation. Plugins wrap these via hooks."""

from __future__ import annotations

import logging
import math
import signal
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, cast

import torch

from distrun.registry.collect import choose_strategy, collect_strategies
from distrun.spec.errors import DistrunError, UsageError
from distrun.spec.keys import UNEVEN_EPOCH
from distrun.spec.stash import StashKey
from distrun.train.rng import seed_everything
from distrun.train.run import Run
from distrun.train.sampler import ResumableSampler, ShardedEvalSampler
from distrun.train.step_sync import NONE, PREEMPT, STEP_SYNC, StepSync

__all__ = ["fit_loop", "setup_run"]

log = logging.getLogger("distrun")


def setup_run(run: Run) -> None:
    """Strategy, model, optimizer and data, each through its hook."""
    info = choose_strategy(run.config, run.world_size, collect_strategies(run.pm),
                           run.pm.is_blocked)
    run.strategy = info.factory(run.config)
    run.strategy.setup(run)
    run.hook.distrun_setup_strategy(run=run)
    if not run.strategy.trains:
        return  # a serving rank (RPC parameter server): nothing to build here
    seed_everything(run.config.seed)
    run.model = run.task.configure_model()
    if not isinstance(run.model, torch.nn.Module):
        raise UsageError("task.configure_model() must return a torch.nn.Module")
    run.hook.distrun_setup_model(run=run)
    run.hook.distrun_setup_optimizer(run=run)
    run.hook.distrun_setup_data(run=run)


# -- the core's implementations of the setup hooks ------------------------------------------


def wrap_model(run: Run) -> None:
    run.model = run.strategy.wrap_model(run.model)


def build_optimizer(run: Run) -> None:
    if run.optimizer is None:
        run.optimizer = run.task.configure_optimizer(run.model.parameters())
        sched = getattr(run.task, "configure_scheduler", None)
        if sched is not None and run.lr_scheduler is None:
            run.lr_scheduler = sched(run.optimizer)
    run.optimizer = run.strategy.wrap_optimizer(run.optimizer)


def _is_map_dataset(data: Any) -> bool:
    return hasattr(data, "__getitem__") and hasattr(data, "__len__") and not isinstance(
        data, torch.utils.data.DataLoader
    )


def build_loaders(run: Run) -> None:
    cfg, st = run.config, run.strategy
    collate = getattr(run.task, "collate_fn", None)
    # A generator of its own: iter(DataLoader) otherwise draws a seed from the global RNG,
    # so a resume mid-epoch would shift the RNG stream (dropout) against the uninterrupted run.
    common: dict[str, Any] = dict(num_workers=cfg.num_workers, collate_fn=collate,
                  pin_memory=st.device.type == "cuda",
                  persistent_workers=cfg.num_workers > 0,
                  generator=torch.Generator().manual_seed(cfg.seed))
    data = run.task.train_data()
    if _is_map_dataset(data):
        run.sampler = ResumableSampler(len(data), cfg.batch_size, st.dp_rank, st.dp_world_size,
                                       seed=cfg.seed)
        run.train_loader = torch.utils.data.DataLoader(data, batch_sampler=run.sampler, **common)
    else:
        run.train_loader = data
    val = run.task.val_data() if hasattr(run.task, "val_data") else None
    if val is not None and _is_map_dataset(val):
        local = max(1, cfg.batch_size // st.dp_world_size)
        sampler = ShardedEvalSampler(len(val), local, st.dp_rank, st.dp_world_size)
        run.val_loader = torch.utils.data.DataLoader(val, batch_sampler=sampler, **common)
    else:
        run.val_loader = val


# -- the loop ------------------------------------------------------------------------------


def to_device(batch: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def _batch_len(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_len(batch[0])
    return 1


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


class _Window:
    """Loss and sample counts since the last log, kept as tensors (no per-step sync)."""

    #: losses kept before they are summed into one tensor (bounds the memory of long windows)
    FOLD = 64

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.folded: torch.Tensor | None = None
        self.micro = 0
        self.samples = 0
        self.started = time.perf_counter()

    def add_loss(self, loss: torch.Tensor) -> None:
        """Keep the step's loss (a list append: the sum is taken at the log step)."""
        self.losses.append(loss.detach())
        if len(self.losses) >= self.FOLD:
            self.folded = self.total()
            self.losses = []

    def total(self) -> torch.Tensor:
        """The sum of the losses so far, in float64, on their device (0 when there is none)."""
        parts = [_sum(self.losses)] if self.losses else []
        if self.folded is not None:
            parts.append(self.folded)
        if not parts:
            return torch.zeros((), dtype=torch.float64)
        return parts[0] if len(parts) == 1 else parts[0] + parts[1]


def _sum(losses: list[torch.Tensor]) -> torch.Tensor:
    try:
        return torch.stack(losses).to(torch.float64).sum()
    except RuntimeError:  # losses of different shapes or devices: one at a time
        return sum((t.to(torch.float64).sum() for t in losses), torch.zeros((), dtype=torch.float64,
                                                                           device=losses[0].device))


#: the loop's own slots on the run
_WINDOW: StashKey[_Window] = StashKey("loop.window")
_VALIDATED_AT: StashKey[int] = StashKey("loop.validated_at_step")


def fit_loop(run: Run) -> Any:
    """The core's ``distrun_run_fit``: epochs until max_epochs/max_steps or a stop."""
    cfg = run.config
    run.stash[_WINDOW] = _Window()
    sync = run.stash[STEP_SYNC] = StepSync(run)
    sync.pack_metrics = lambda step: _pack_window(run, step)
    run.progress.step_started = time.monotonic()
    if run.sampler is not None:
        run.sampler.epoch = run.progress.epoch
    while run.progress.epoch < cfg.max_epochs and not run.done:
        run.hook.distrun_run_epoch(run=run, epoch=run.progress.epoch)
        _await_ranks(run, run.progress.epoch)
        if _stop_agreed(run, sync.drain()) == PREEMPT:
            break
        finished = run.progress.epoch
        if not run.done or _epoch_complete(run):
            if run.val_loader is not None:
                validate(run)
            run.progress.epoch += 1
            if run.sampler is not None:
                run.sampler.set_epoch(run.progress.epoch)
            run.hook.distrun_on_epoch_end(run=run, epoch=finished)
    _stop_agreed(run, sync.drain(metrics=True))  # and logs the last, partial window
    stopped = run.stop_signal is not None
    if not stopped and run.val_loader is not None \
            and run.stash.get(_VALIDATED_AT) != run.progress.step:
        validate(run)
    return run.progress


_NONFINITE_SEEN: StashKey[bool] = StashKey("loop.nonfinite_seen")


def _describe(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, dict):
        return f"a dict (keys {', '.join(map(repr, list(value)[:5]))})"
    return f"a {type(value).__name__} ({str(value)[:40]!r})"


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
    store = dist.distributed_c10d._get_default_store()
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
    training_step, backward = _direct(hook.distrun_training_step), _direct(hook.distrun_backward)
    optimizer_step, step_end = _direct(hook.distrun_optimizer_step), \
        _direct(hook.distrun_on_step_end)
    model.train()
    micro_in_step = 0
    for batch, last in _with_last(run.train_loader):
        batch = to_device(batch, st.device)
        micro_in_step += 1
        boundary = micro_in_step == accum or last
        ctx = st.no_sync(model) if not boundary else _NULL
        with ctx:
            loss = training_step(run=run, batch=batch)
            _check_loss(run, loss, epoch)
            backward(run=run, loss=loss / accum if accum > 1 else loss)
        if run.sampler is not None:
            run.sampler.advance()
        run.progress.micro_step += 1
        window.add_loss(loss)
        window.micro += 1
        window.samples += local_batch if local_batch is not None else _batch_len(batch)
        if not boundary:
            continue
        micro_in_step = 0
        optimizer_step(run=run)
        run.optimizer.zero_grad(set_to_none=True)
        if run.lr_scheduler is not None:
            run.lr_scheduler.step()
        prog = run.progress
        prog.step += 1
        prog.step_started = time.monotonic()
        if step_end is not _nothing:
            step_end(run=run, step=prog.step, metrics={"loss": loss.detach(), "epoch": epoch})
        _stop_agreed(run, sync.boundary())  # at log steps, also reduces and logs metrics
        if val_every and prog.step % val_every == 0 and run.val_loader is not None:
            validate(run)
            model.train()
        if 0 <= cfg.max_steps <= prog.step:
            run.done = True
        if run.done:
            break
    return epoch + 1


def _direct(caller: Any) -> Callable[..., Any]:
    """What to call for a per-step hook: when a single plain implementation answers it (the
    core's, for a run without mixed precision or loss-parallel TP), that function itself, so
    the step skips pluggy's dispatch; otherwise the hook. Resolved once per epoch: plugins add
    per-step hooks at setup or at the start of the fit (``run.add_hooks``)."""
    impls = caller.get_hookimpls()
    if not impls:
        return _nothing
    spec = caller.spec
    if len(impls) == 1 and not (impls[0].hookwrapper or impls[0].wrapper) and spec is not None \
            and tuple(impls[0].argnames) == tuple(spec.argnames):
        return cast(Callable[..., Any], impls[0].function)
    return cast(Callable[..., Any], caller)


def _nothing(**kwargs: Any) -> None:
    return None


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_NULL = _Null()


def _pack_window(run: Run, step: int) -> tuple[torch.Tensor, Callable[[torch.Tensor], None]]:
    """The window since the last log as values to sum over ranks, and what logs the sums as
    ``step`` (the step sync sends them with its vote and calls ``done`` at the next boundary,
    so no rank waits on them)."""
    window = run.stash[_WINDOW]
    loss = window.total()
    packed = torch.stack([  # on the loss's device: no host sync here
        loss.reshape(()),
        torch.tensor(float(window.micro), dtype=torch.float64, device=loss.device),
        torch.tensor(float(window.samples), dtype=torch.float64, device=loss.device)])
    elapsed = max(time.perf_counter() - window.started, 1e-9)
    window.reset()
    epoch = float(run.progress.epoch)
    lr = None
    if run.optimizer is not None and run.optimizer.param_groups:
        lr = float(run.optimizer.param_groups[0].get("lr", 0.0))

    def done(summed: torch.Tensor) -> None:
        loss_sum, micro, samples = summed.tolist()
        if micro == 0:
            return
        metrics = {
            "loss": loss_sum / micro,
            # ranks of one data-parallel replica (TP) saw the same samples: count them once
            "samples_per_sec": samples / elapsed * run.strategy.dp_world_size / run.world_size,
            "epoch": epoch,
            "step": float(step),
        }
        if lr is not None:
            metrics["lr"] = lr
        run.metrics.update(metrics)
        run.hook.distrun_log_metrics(run=run, step=step, metrics=metrics)

    return packed, done


def validate(run: Run) -> Mapping[str, float]:
    sync = run.stash.get(STEP_SYNC)
    if sync is not None:
        sync.flush()  # the training row of this step is logged before the validation row
    metrics = run.hook.distrun_run_validation(run=run) or {}
    run.stash[_VALIDATED_AT] = run.progress.step
    if metrics:
        run.metrics.update(metrics)
        run.hook.distrun_on_validation_end(run=run, step=run.progress.step, metrics=metrics)
        run.hook.distrun_log_metrics(run=run, step=run.progress.step, metrics=dict(metrics))
    return metrics


def validation_loop(run: Run) -> dict[str, float]:
    """The core's ``distrun_run_validation``: sample-weighted means reduced over ranks."""
    step_fn = getattr(run.task, "validation_step", None)
    if step_fn is None or run.val_loader is None:
        return {}
    model, st = run.model, run.strategy
    was_training = model.training
    model.eval()
    names: list[str] = []
    sums: torch.Tensor | None = None
    count = 0.0
    with torch.no_grad():
        for batch in run.val_loader:
            batch = to_device(batch, st.device)
            out = step_fn(model, batch)
            if out is None:
                continue
            if not isinstance(out, Mapping):
                out = {"val_loss": out}
            n = float(_batch_len(batch))
            if not names:
                names = [k if k.startswith("val_") else f"val_{k}" for k in out]
            vals = torch.stack([torch.as_tensor(v, dtype=torch.float64).detach().cpu().reshape(())
                                for v in out.values()]) * n
            sums = vals if sums is None else sums + vals
            count += n
    model.train(was_training)
    if sums is None:
        return {}
    packed = torch.cat([sums, torch.tensor([count], dtype=torch.float64)]).to(st.device)
    st.all_reduce(packed, "sum")
    values = packed.tolist()
    total = values[-1]
    return {name: v / total for name, v in zip(names, values[:-1])}
