"""The user's task: what to train. Subclassing :class:`Task` is optional (duck typing works)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any

from distrun._spec.errors import UsageError

__all__ = ["Task", "load_task"]


class Task:
    """A training task in plain PyTorch; override what you need.

    Required: ``configure_model()``, ``train_data()`` and ``training_step(model, batch)``
    (which returns the loss, or a dict with ``"loss"`` whose other keys are logged). For the
    test stage, define ``test_step(model, batch)`` (a loss or a dict of metrics, logged as
    ``test_NAME``) and ``test_data()``.
    ``train_data()`` returns a map-style ``Dataset`` (distrun shards and resumes it) or any
    iterable of batches (used as-is on each rank: your code shards it).
    """

    #: False: ``training_step`` steps the optimizers itself (``self.optimizers()``,
    #: ``self.manual_backward(loss)``, ``opt.step()``), as Lightning's manual optimization;
    #: needed for several optimizers (``configure_optimizers``). See distrun._train.manual.
    automatic_optimization: bool = True

    def configure_model(self) -> Any:
        raise NotImplementedError("Task.configure_model() must return an nn.Module")

    def configure_optimizer(self, params: Any) -> Any:
        import torch

        return torch.optim.AdamW(params, lr=1e-3)

    def train_data(self) -> Any:
        raise NotImplementedError("Task.train_data() must return a Dataset or an iterable")

    def val_data(self) -> Any:
        return None

    def training_step(self, model: Any, batch: Any) -> Any:
        raise NotImplementedError("Task.training_step(model, batch) must return the loss")

    def validation_step(self, model: Any, batch: Any) -> Any:
        return None

    def configure_scheduler(self, optimizer: Any) -> Any:
        """A scheduler, a dict (``{"scheduler": s, "interval": "epoch", "monitor":
        "val_loss"}``) or a list of them; see :mod:`distrun._train.schedulers`."""
        return None

    # test and predict stages (``distrun run --stage test``, ``Trainer.test``) ------------
    def test_data(self) -> Any:
        return None

    def predict_data(self) -> Any:
        """What to predict over (default: ``test_data()``)."""
        return self.test_data()

    def predict_step(self, model: Any, batch: Any) -> Any:
        """Outputs for a batch, one row per sample (default: ``model(batch)``, or
        ``model(batch[0])`` for a tuple or list)."""
        return model(batch[0] if isinstance(batch, (list, tuple)) else batch)

    # manual optimization (automatic_optimization = False) ------------------------------
    def optimizers(self) -> Any:
        """The run's optimizer (a list when ``configure_optimizers`` returned several), each
        stepped through the run: ``opt.step()`` unscales and clips (``--grad-clip``)."""
        from distrun._train.manual import task_optimizers

        return task_optimizers(self)

    def lr_schedulers(self) -> Any:
        """The run's schedulers (None, one, or a list); under manual optimization the task
        steps them. Their states are checkpointed either way."""
        from distrun._train.manual import task_schedulers

        return task_schedulers(self)

    def manual_backward(self, loss: Any) -> None:
        """``loss.backward()`` as the run does it: scaled by a GradScaler (16-mixed), the
        gradients synced by the strategy."""
        from distrun._train.manual import manual_backward

        manual_backward(self, loss)

    def save_hyperparameters(self, *names: str, **values: Any) -> None:
        """Record hyperparameters as ``self.hparams`` (Lightning's ``save_hyperparameters``).

        Called in ``__init__`` with no arguments it takes every argument of that
        ``__init__``; ``names`` pick some of them, ``values`` add others. They must be JSON
        values. Rank 0 writes them to ``RUN_DIR/hparams.json`` when the run starts, and each
        checkpoint holds them (state ``hparams``)."""
        import inspect
        import json

        frame = inspect.currentframe()
        caller = frame.f_back if frame is not None else None
        found: dict[str, Any] = {}
        if caller is not None and caller.f_code.co_name == "__init__":
            args = inspect.getargvalues(caller)
            for name in args.args[1:]:
                found[name] = args.locals[name]
            if args.keywords:
                found.update(args.locals[args.keywords])
        del frame, caller
        if names:
            missing = [n for n in names if n not in found]
            if missing:
                raise UsageError(f"save_hyperparameters({', '.join(map(repr, names))}): "
                                 f"{', '.join(missing)} is not an argument of __init__")
            found = {n: found[n] for n in names}
        found.update(values)
        try:
            json.dumps(found)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"save_hyperparameters: the values must be JSON values ({exc}); "
                             "pass the plain ones by name") from None
        self.hparams: dict[str, Any] = {**getattr(self, "hparams", {}), **found}

    # -- where the run is (Lightning's ``self.trainer``, ``self.current_epoch`` ...) ---------
    @property
    def trainer(self) -> Any:
        """The :class:`distrun.Run` this task is in (``current_epoch``, ``global_step``,
        ``callback_metrics``, ``should_stop``, ``config``, ``strategy`` ...); None outside."""
        from distrun._train.run import run_of

        return run_of(self)

    @property
    def current_epoch(self) -> int:
        """The epoch being trained (from 0)."""
        return self._progress("epoch")

    @property
    def global_step(self) -> int:
        """Optimizer steps done so far in the run (resumed runs count on)."""
        return self._progress("step")

    @property
    def batch_idx(self) -> int:
        """The index in its epoch of the micro-batch a ``training_step`` is given."""
        return self._progress("batch_idx")

    @property
    def global_rank(self) -> int:
        return int(os.environ.get("RANK", "0")) if self.trainer is None else self.trainer.rank

    def _progress(self, name: str) -> int:
        run = self.trainer
        return 0 if run is None else int(getattr(run.progress, name))

    def log(self, name: str, value: Any, *, on_step: bool | None = None,
            on_epoch: bool | None = None, reduce: str = "mean") -> None:
        """Log a number from a step: per log row in training (``on_step``), per epoch
        (``on_epoch``) or per pass in validation/test; reduced over ranks (``"mean"`` or
        ``"sum"``), written by every logger. Every rank must log the same names.

        ``value`` may be a torchmetrics metric the step updates (``self.log("val_acc",
        self.val_acc)``): its ``compute()`` over every rank is logged at the end of the pass
        or epoch, and it is reset there (:mod:`distrun._train.metric_objects`)."""
        from distrun._train.metrics import log

        log(name, value, on_step=on_step, on_epoch=on_epoch, reduce=reduce)


def load_task(target: str) -> Any:
    """Build the task named ``pkg.module:Class`` or ``path/to/file.py:Class`` (no arguments)."""
    where, _, attr = target.rpartition(":")
    if not where or not attr:
        raise UsageError(f"task target {target!r} must look like pkg.module:Class or file.py:Class")
    if where.endswith(".py"):
        if not os.path.isfile(where):
            raise UsageError(f"task file not found: {where}")
        name = "_distrun_task_" + os.path.splitext(os.path.basename(where))[0]
        spec = importlib.util.spec_from_file_location(name, where)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules[name] = module
        sys.path.insert(0, os.path.dirname(os.path.abspath(where)))
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as exc:
            raise UsageError(f"cannot import task module {where!r}: {exc}") from None
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise UsageError(f"{where} has no attribute {attr!r} (check the :Class part)") from None
    return obj() if isinstance(obj, type) else obj
