"""distrun: a small PyTorch distributed training loop with a pluggy plugin ecosystem.

Importing this package does not import torch; the loop imports it when it runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distrun._version import __version__
from distrun.spec.errors import DistrunError, UsageError
from distrun.spec.markers import hookimpl, hookspec
from distrun.spec.options import Option, plugin_options
from distrun.spec.stash import Stash, StashKey
from distrun.spec.strategy import StrategyInfo

if TYPE_CHECKING:
    from distrun.config.run_config import RunConfig
    from distrun.train.run import Run
    from distrun.train.task import Task
    from distrun.train.trainer import Trainer

__all__ = [
    "DistrunError",
    "Option",
    "Run",
    "RunConfig",
    "Stash",
    "StashKey",
    "StrategyInfo",
    "Task",
    "Trainer",
    "UsageError",
    "__version__",
    "fit",
    "hookimpl",
    "hookspec",
    "plugin_options",
]

_LAZY = {
    "RunConfig": "distrun.config.run_config",
    "Run": "distrun.train.run",
    "Task": "distrun.train.task",
    "Trainer": "distrun.train.trainer",
}


def __getattr__(name: str) -> Any:
    # Torch-importing names load on first use so `distrun --help` stays torch-free.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'distrun' has no attribute {name!r}")


def fit(task: Any, **options: Any) -> Any:
    """Train ``task`` with the loop; ``options`` are run-config fields (flags win over them)."""
    from distrun.train.trainer import Trainer

    return Trainer(**options).fit(task)
