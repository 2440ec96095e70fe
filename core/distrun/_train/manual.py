"""Manual optimization: the task steps its optimizers itself, as Lightning's
``automatic_optimization = False`` does.

In ``training_step(model, batch)`` the task calls ``self.optimizers()`` (one
:class:`TaskOptimizer`, or a list for several), ``self.manual_backward(loss)`` and
``opt.step()`` / ``opt.zero_grad()``; ``self.lr_schedulers()`` gives the schedulers, which the
task steps (the loop does not, as in Lightning). What the automatic loop does around a step
still happens, per optimizer step: ``manual_backward`` goes through the backward hook (a
GradScaler scales the loss there; autocast is off during backward), and ``opt.step()`` through
the optimizer-step hook (unscale, ``--grad-clip`` of that optimizer's parameters, the step,
the scaler's update). A batch is one training step (``run.progress.step``), however many
optimizers it steps. ``--grad-accum`` is refused: accumulating is the task's to do.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from distrun._spec.errors import UsageError
from distrun._spec.stash import StashKey
from distrun._train.models import params_of
from distrun._train.optimizers import inner_optimizers
from distrun._train.run import run_of

__all__ = ["TaskOptimizer", "bound_run", "manual_backward", "manual_epoch_loop",
           "task_optimizers", "task_schedulers"]

#: the TaskOptimizer of each of the run's optimizers (made on first use)
_WRAPPED: StashKey[tuple[Any, list[TaskOptimizer]]] = StashKey("manual.optimizers")


def bound_run(task: Any, what: str) -> Any:
    run = run_of(task)
    if run is None or run.optimizer is None:
        raise UsageError(f"{type(task).__name__}.{what} is available once the trainer has set "
                         "the task up (in training_step and later), not before")
    return run


class TaskOptimizer:
    """One of the run's optimizers as the task steps it: ``step()`` and ``zero_grad()`` go
    through the run (hooks: AMP, clipping); anything else is the optimizer's own."""

    def __init__(self, run: Any, optimizer: Any) -> None:
        self._run = run
        self.optimizer = optimizer

    def step(self, closure: Any = None) -> Any:
        """Step this optimizer as the loop steps one: unscale and clip its parameters'
        gradients (``--grad-clip``), step, update the scaler. ``closure``, when given, is
        called first (it computes the loss and its backward) and its value returned."""
        loss = closure() if closure is not None else None
        run = self._run
        saved = run.optimizer, run.model
        # the step hooks act on run.optimizer and clip run.model's parameters: for this
        # step, that is this optimizer and its parameters
        run.optimizer, run.model = self.optimizer, params_of(self.optimizer)
        try:
            run.hook.distrun_optimizer_step(run=run)
        finally:
            run.optimizer, run.model = saved
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["optimizer"], name)

    def __repr__(self) -> str:
        return f"TaskOptimizer({self.optimizer!r})"


def task_optimizers(task: Any) -> Any:
    """The run's optimizers for the task: one :class:`TaskOptimizer`, or a list of them."""
    run = bound_run(task, "optimizers()")
    cached = run.stash.get(_WRAPPED)
    if cached is None or cached[0] is not run.optimizer:
        cached = (run.optimizer, [TaskOptimizer(run, o) for o in inner_optimizers(run.optimizer)])
        run.stash[_WRAPPED] = cached
    wrapped = cached[1]
    return wrapped[0] if len(wrapped) == 1 else list(wrapped)


def task_schedulers(task: Any) -> Any:
    """The run's schedulers: None, one, or a list (in the order the task returned them)."""
    run = bound_run(task, "lr_schedulers()")
    found = [s.scheduler for s in run.schedulers]
    if not found:
        return None
    return found[0] if len(found) == 1 else found


def manual_backward(task: Any, loss: torch.Tensor) -> None:
    """Back-propagate ``loss`` through the run's backward hook (scaled under 16-mixed), with
    autocast off (backward runs in the dtypes of the forward)."""
    run = bound_run(task, "manual_backward(loss)")
    if not isinstance(loss, torch.Tensor):
        raise UsageError(f"manual_backward(loss) got {type(loss).__name__}; pass the loss "
                         "tensor")
    device_type = run.device.type
    with torch.autocast(device_type=device_type, enabled=False) \
            if torch.is_autocast_enabled(device_type) else _null():
        run.hook.distrun_backward(run=run, loss=loss)


def _null() -> Any:
    import contextlib

    return contextlib.nullcontext()


def manual_epoch_loop(run: Any, epoch: int) -> int:
    """The core's ``distrun_run_epoch`` under manual optimization: one training step per
    batch, the task's ``training_step`` doing backward and the optimizer steps."""
    from distrun._diagnose.position import Phase, marks
    from distrun._spec.keys import UNEVEN_EPOCH
    from distrun._train.log_window import _WINDOW
    from distrun._train.loop import _check_loss, _loss_of, epoch_start, step_boundary
    from distrun._train.metrics import logging_to
    from distrun._train.step_sync import STEP_SYNC
    from distrun._train.tensors import batch_len, to_device

    cfg, st, hook = run.config, run.strategy, run.hook
    model, window, sync = run.model, run.stash[_WINDOW], run.stash[STEP_SYNC]
    val_every = 0 if run.stash.get(UNEVEN_EPOCH) else cfg.val_every_n_steps
    local_batch = run.sampler.local_batch if run.sampler is not None else None
    target, batches = epoch_start(run, epoch, model)
    rec = marks()
    with logging_to(target):
        for batch, _last in batches:
            batch = to_device(batch, st.device)
            rec.phase(Phase.FORWARD)  # the task's step: forward, backward and optimizer
            out = hook.distrun_training_step(run=run, batch=batch)
            if isinstance(out, Mapping) and "loss" in out:
                out = _loss_of(run, out, target)  # the loss; the other values are logged
            elif isinstance(out, Mapping):  # values to log only
                target.add_many(out)
                out = None
            if out is not None:  # the loss, to log (the task did its own backward)
                _check_loss(run, out, epoch)
                window.add_loss(out)
                window.micro += 1
            if run.sampler is not None:
                run.sampler.advance()
            prog = run.progress
            prog.micro_step += 1
            window.samples += local_batch if local_batch is not None else batch_len(batch)
            prog.step += 1
            prog.step_started = time.monotonic()
            rec.step_done(prog.step)
            metrics: dict[str, Any] = {"epoch": epoch}
            if out is not None:
                metrics["loss"] = out.detach()
            hook.distrun_on_step_end(run=run, step=prog.step, metrics=metrics)
            if step_boundary(run, sync, val_every, model):
                break
    return epoch + 1
