"""distrun: a small PyTorch distributed training loop with a pluggy plugin ecosystem.

Importing this package does not import torch; the loop imports it when it runs.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from distrun._spec.errors import DistrunError, UsageError
from distrun._spec.markers import hookimpl
from distrun._version import __version__

if TYPE_CHECKING:
    from distrun._config.run_config import RunConfig
    from distrun._train.callbacks import Callback
    from distrun._train.datamodule import DataModule
    from distrun._train.models import Models
    from distrun._train.run import Run
    from distrun._train.task import Task
    from distrun._train.trainer import Trainer

# The users' API. ``hookimpl`` is here because a Task may implement hooks itself; what a
# plugin author needs is in :mod:`distrun.plugin`.
__all__ = [
    "Callback",
    "DataModule",
    "DistrunError",
    "Models",
    "Run",
    "RunConfig",
    "Task",
    "Trainer",
    "UsageError",
    "__version__",
    "fit",
    "hookimpl",
    "log",
    "predict",
    "test",
    "validate",
]

_LAZY = {
    "Callback": "distrun._train.callbacks",
    "DataModule": "distrun._train.datamodule",
    "Models": "distrun._train.models",
    "RunConfig": "distrun._config.run_config",
    "Run": "distrun._train.run",
    "Task": "distrun._train.task",
    "Trainer": "distrun._train.trainer",
}


#: plugin-author names this module used to export, and where they live now (the plugin API,
#: or, for the older forms of an option's declaration and the stash, the private modules)
_MOVED = {"BackendInfo": "distrun.plugin", "StashKey": "distrun.plugin",
          "StrategyInfo": "distrun.plugin", "hookspec": "distrun.plugin",
          "Option": "distrun._spec.options", "plugin_options": "distrun._spec.options",
          "Stash": "distrun._spec.stash"}


def __getattr__(name: str) -> Any:
    # Torch-importing names load on first use so `distrun --help` stays torch-free.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _MOVED:
        import importlib
        import warnings

        warnings.warn(f"distrun.{name} moved to distrun.plugin.{name} (the plugin API)"
                      if _MOVED[name] == "distrun.plugin" else
                      f"distrun.{name} is deprecated: a plugin declares its options with "
                      "distrun.plugin.PluginOptions and keeps state under a StashKey",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module 'distrun' has no attribute {name!r}")


def fit(task: Any, **options: Any) -> Any:
    """Train ``task`` with the loop; ``options`` are run-config fields (flags win over them).

    The model stays live for a :func:`validate`, :func:`test` or :func:`predict` of the same
    task object that follows in this process."""
    return _trainer(task, options).fit(task)


def validate(task: Any, ckpt_path: str | None = None, **options: Any) -> Any:
    """Validation metrics of ``task`` (after :func:`fit` of it: on its trained model)."""
    return _trainer(task, options).validate(task, ckpt_path)


def test(task: Any, ckpt_path: str | None = None, **options: Any) -> Any:
    """Test metrics of ``task`` over ``test_data()`` with ``test_step``."""
    return _trainer(task, options).test(task, ckpt_path)


def predict(task: Any, ckpt_path: str | None = None, **options: Any) -> Any:
    """``predict_step`` outputs of ``task`` over ``predict_data()``, in dataset order."""
    return _trainer(task, options).predict(task, ckpt_path)


def log(name: str, value: Any, *, on_step: bool | None = None, on_epoch: bool | None = None,
        reduce: str = "mean") -> None:
    """Log ``value`` as ``name`` from inside a step (see :meth:`distrun.Task.log`)."""
    from distrun._train.metrics import log as _log

    _log(name, value, on_step=on_step, on_epoch=on_epoch, reduce=reduce)


#: the attribute a module-level call leaves on the task: (pid, options, trainer), so that the
#: next call for the same task object reuses its live trainer (Lightning's ``model.trainer``)
_SESSION = "_distrun_session"


def _trainer(task: Any, options: dict[str, Any]) -> Any:
    """The trainer an earlier module-level call left on this task (its model is live), else a
    new one, left there for the next call. A forked process (the notebook launcher's ranks)
    has none of its parent's sessions: the pid must match."""
    from distrun._train.trainer import Trainer

    held = getattr(task, _SESSION, None)
    if isinstance(held, tuple) and held[0] == os.getpid() and (not options or options == held[1]):
        return held[2]
    trainer = Trainer(**options)
    try:
        setattr(task, _SESSION, (os.getpid(), options, trainer))
    except (AttributeError, TypeError):  # a task that takes no attributes: no reuse
        pass
    return trainer
