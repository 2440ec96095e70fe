"""The strategy contract: one small object per run that owns parallelism.

This module is torch-free: plugins import ``StrategyInfo`` at import time, and the
``Strategy`` protocol is only a type. A concrete strategy lives in its plugin.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from distrun.config.run_config import RunConfig
    from distrun.train.run import Run

__all__ = ["Strategy", "StrategyInfo"]


@dataclass(frozen=True)
class StrategyInfo:
    """A strategy offered by a plugin through ``distrun_register_strategies``.

    ``factory(config)`` builds the strategy inside a worker; it may import torch. ``multi_process``
    says whether the strategy expects several processes (ddp) or exactly one (single, dp).
    """

    name: str
    factory: Callable[[RunConfig], Strategy]
    help: str = ""
    plugin: str = "core"
    multi_process: bool = True


@runtime_checkable
class Strategy(Protocol):
    """What the loop asks of a strategy. Every method has a plain default in ``BaseStrategy``.

    Lifecycle, on every rank: ``setup(run)`` (process group, device, mesh) -> ``wrap_model`` ->
    ``wrap_optimizer`` -> per step ``no_sync``/``backward``/``optimizer_step`` -> ``teardown``.
    """

    name: str
    device: torch.device
    rank: int
    world_size: int
    #: ranks that see different data (the data cursor shards over these)
    dp_rank: int
    dp_world_size: int
    #: False on ranks that only serve others (RPC parameter servers): the trainer skips the
    #: model, data, checkpoint restore and loop there after ``setup``, then tears down
    trains: bool

    def setup(self, run: Run) -> None: ...

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module: ...

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer: ...

    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module: ...

    def no_sync(self, model: torch.nn.Module) -> AbstractContextManager[Any]: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None: ...

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor: ...

    def barrier(self) -> None: ...

    def teardown(self) -> None: ...
