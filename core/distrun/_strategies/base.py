"""``BaseStrategy``: plain defaults for every strategy method; ``single`` is exactly this.

A plugin strategy overrides only what differs (DDP: ``wrap_model``, ``no_sync``...). The base
joins a process group when the run has several processes, so a strategy that only changes
how the model is wrapped needs nothing else.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from distrun._config.run_config import RunConfig
from distrun._strategies.process_group import env_topology, init_process_group, select_device

if TYPE_CHECKING:
    from distrun._spec.strategy import SetupView, Strategy

__all__ = ["BaseStrategy"]

_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN", "avg": "AVG"}


class BaseStrategy:
    """One process per rank, the model replicated as-is, gradients left alone.

    Implements :class:`distrun._spec.strategy.Strategy`; ``tox -e lint`` type-checks that.
    """

    name: str = "base"
    trains: bool = True

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.rank, self.local_rank, self.world_size = env_topology()
        self.dp_rank, self.dp_world_size = self.rank, self.world_size
        self.device = torch.device("cpu")
        self._owns_group = False

    # -- setup ---------------------------------------------------------------------------
    def setup(self, run: SetupView) -> None:
        self.device = select_device(self.config, self.local_rank)
        if self.world_size > 1:
            self._owns_group = init_process_group(self.config, self.device)

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.to(self.device)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def compile_model(self, model: torch.nn.Module) -> None:
        """``--compile``: torch.compile what runs the steps, in place (``nn.Module.compile``:
        the module and its ``state_dict`` keys stay as they were). A strategy whose wrapped
        model is not what runs (a pipeline's stages) compiles those instead."""
        model.compile()

    # -- per step ------------------------------------------------------------------------
    def no_sync(self, model: torch.nn.Module) -> AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    # -- collectives ---------------------------------------------------------------------
    @property
    def distributed(self) -> bool:
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(tensor, op=getattr(dist.ReduceOp, _OPS[op]))
        return tensor

    def all_reduce_async(self, tensor: torch.Tensor, op: str = "sum") -> Any:
        if self.distributed:
            return dist.all_reduce(tensor, op=getattr(dist.ReduceOp, _OPS[op]), async_op=True)
        return None

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def teardown(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False


if TYPE_CHECKING:
    # The type checker proves the base (and so every subclass) satisfies the contract.
    _contract: type[Strategy] = BaseStrategy
