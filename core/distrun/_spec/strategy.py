"""The strategy contract: one small object per run that owns parallelism.

This module is torch-free: plugins import ``StrategyInfo`` at import time, and the
``Strategy`` protocol is only a type. A concrete strategy lives in its plugin.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from distrun._spec.stash import Stash
from distrun._spec.targets import import_target

if TYPE_CHECKING:
    import torch

    from distrun._config.run_config import RunConfig

__all__ = ["SetupView", "Strategy", "StrategyInfo"]


@dataclass(frozen=True)
class StrategyInfo:
    """A strategy offered by a plugin through ``distrun_register_strategies``.

    ``factory(config)`` builds the strategy inside a worker; it may import torch. Given as a
    ``"module:Class"`` string it is imported only where the strategy is built (:meth:`build`),
    so the plugin's entry point imports nothing.
    ``multi_process`` says whether the strategy expects several processes (ddp) or exactly one
    (single, dp).
    ``auto_priority`` > 0 offers the strategy to ``--strategy auto`` for several processes:
    the multi-process strategy with the highest one is chosen (0: only when named).
    ``layout(config, world_size)`` (a callable or a ``"module:function"`` string; torch-free)
    returns how many data-parallel ranks the strategy makes of ``world_size`` ranks under
    ``config``, and raises :class:`~distrun._spec.errors.UsageError` for a layout it cannot
    build (a tensor-parallel size that does not divide the world). The launcher calls it before
    any worker starts, and checks the global batch against it; without one, the workers find
    such mistakes.
    """

    name: str
    factory: Callable[[RunConfig], Strategy] | str
    help: str = ""
    plugin: str = "core"
    multi_process: bool = True
    layout: Callable[[RunConfig, int], int] | str | None = None
    auto_priority: int = 0

    def __post_init__(self) -> None:
        for what, value in (("factory", self.factory), ("layout", self.layout)):
            if isinstance(value, str):
                module, sep, attr = value.partition(":")
                if not (module and sep and attr):
                    raise ValueError(f"a strategy {what} string is 'module:name', not {value!r}")

    def build(self, config: RunConfig) -> Strategy:
        """The strategy for ``config`` (in a worker: the factory may import torch)."""
        factory = import_target(self.factory) if isinstance(self.factory, str) else self.factory
        strategy: Strategy = factory(config)
        return strategy

    def data_parallel_size(self, config: RunConfig, world_size: int) -> int | None:
        """``layout(config, world_size)``, or None when the strategy declares no layout."""
        if self.layout is None:
            return None
        layout = import_target(self.layout) if isinstance(self.layout, str) else self.layout
        return int(layout(config, world_size))


class SetupView(Protocol):
    """What a strategy's ``setup`` may use of the run (the run itself, seen through its seam)."""

    #: where a strategy publishes what others read (its mesh: :data:`distrun._spec.keys.DEVICE_MESH`)
    stash: Stash

    @property
    def config(self) -> RunConfig: ...

    @property
    def task(self) -> Any: ...

    @property
    def log(self) -> logging.Logger: ...


@runtime_checkable
class Strategy(Protocol):
    """What the loop asks of a strategy. Every method has a plain default in ``BaseStrategy``.

    Lifecycle, on every rank: ``setup(run)`` (process group, device, mesh) -> ``wrap_model`` ->
    ``wrap_optimizer`` -> per step ``no_sync``/``backward``/``optimizer_step`` -> ``teardown``.
    Optional: ``compile_model(model)`` under ``--compile`` (``BaseStrategy``'s compiles the
    wrapped model in place; a strategy whose wrapped model is not what runs the steps, as a
    pipeline's, compiles what does).
    """

    name: str
    device: torch.device
    rank: int
    local_rank: int
    world_size: int
    #: ranks that see different data (the data cursor shards over these)
    dp_rank: int
    dp_world_size: int
    #: False on ranks that only serve others (RPC parameter servers): the trainer skips the
    #: model, data, checkpoint restore and loop there after ``setup``, then tears down
    trains: bool

    def setup(self, run: SetupView) -> None: ...

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module: ...

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer: ...

    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module: ...

    def no_sync(self, model: torch.nn.Module) -> AbstractContextManager[Any]: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None: ...

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm of ``model`` (across shards and stages); return it."""
        ...

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor: ...

    def all_reduce_async(self, tensor: torch.Tensor, op: str = "sum") -> Any:
        """Start an in-place ``all_reduce``; return a handle whose ``wait()`` ends it, or None
        when there is nothing to reduce with (one process)."""
        ...

    def barrier(self) -> None: ...

    def teardown(self) -> None: ...
