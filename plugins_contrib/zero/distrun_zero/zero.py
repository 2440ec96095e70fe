"""Wrap the run's optimizer in a ZeroRedundancyOptimizer whose ``state_dict`` is portable.

Checkpoints: :meth:`ZeroOptimizer.state_dict` consolidates the shards into the plain
``torch.optim`` format (global parameter indices) on every rank, so the checkpoint plugin
saves it like any replicated optimizer state (split evenly over the ranks that write it) and
it loads into ZeRO at any world size or into the plain optimizer. The ``zero`` entry the plugin
adds to the checkpoint's state records the sharding it was saved with.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from distrun.plugin import Run, UsageError, to_cpu
from distrun_zero.options import ZeroOptions

__all__ = ["ZeroOptimizer", "check_layout", "layout", "shard_optimizer", "state_bytes"]

log = logging.getLogger("distrun")


class ZeroOptimizer(ZeroRedundancyOptimizer):
    """ZeroRedundancyOptimizer whose ``state_dict()`` is collective and complete on every rank."""

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer state in ``torch.optim`` format; every rank must call it."""
        self.consolidate_state_dict(to=0)
        full = [to_cpu(super().state_dict()) if self.rank == 0 else None]
        self._all_state_dicts = []  # the consolidated copy is not kept between checkpoints
        dist.broadcast_object_list(full, src=dist.get_global_rank(self.process_group, 0),
                                   group=self.process_group)
        return full[0]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take this rank's shard of a whole ``torch.optim`` state (the caller's dict is kept)."""
        # torch's version overwrites other ranks' entries of the dict it is given with None
        super().load_state_dict({**state_dict, "state": dict(state_dict["state"])})


def _constructor_defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's defaults its class's constructor takes back.

    ZeroRedundancyOptimizer builds the local optimizer as ``optimizer_class(params,
    **defaults)``; AdamW's defaults hold ``decoupled_weight_decay``, which AdamW's constructor
    refuses (torch >= 2.6). The per-group values still carry every key.
    """
    params = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in params}


def shard_optimizer(run: Run) -> None:
    """Replace ``run.optimizer`` by a :class:`ZeroOptimizer` of the same class and groups."""
    if run.world_size < 2 or not dist.is_initialized():
        log.info("zero: one process, so the optimizer is not sharded")
        return
    if not isinstance(run.model, DistributedDataParallel):
        raise UsageError(
            f"--zero shards the optimizer state over DDP ranks but strategy "
            f"'{run.strategy.name}' does not wrap the model in DistributedDataParallel "
            "(use --strategy ddp, or drop --zero: FSDP already shards optimizer state)")
    inner = run.optimizer
    if isinstance(inner, ZeroRedundancyOptimizer):
        return
    groups = [dict(g) for g in inner.param_groups]
    zero = ZeroOptimizer(groups, optimizer_class=type(inner),
                         parameters_as_bucket_view=ZeroOptions.of(run.config).zero_bucket_view,
                         **_constructor_defaults(inner))
    run.optimizer = zero
    if run.lr_scheduler is not None:
        make = getattr(run.task, "configure_scheduler", None)
        run.lr_scheduler = make(zero) if make is not None else None
        if run.lr_scheduler is None:
            log.warning("zero: the LR scheduler was built on the unsharded optimizer and the task "
                        "has no configure_scheduler(optimizer) to rebuild it; it is dropped")
    mine = sum(p.numel() for g in zero.optim.param_groups for p in g["params"])
    total = sum(p.numel() for g in groups for p in g["params"])
    log.info("zero: %s state sharded over %d ranks (rank 0 holds %d of %d parameters' state)",
             type(inner).__name__, run.world_size, mine, total)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state tensors this rank holds (its shard, under ZeRO)."""
    local = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    return sum(v.numel() * v.element_size() for s in local.state.values()
               for v in s.values() if isinstance(v, torch.Tensor))


def layout(run: Run) -> dict[str, Any]:
    """How the optimizer state was sharded when saved (JSON-able)."""
    opt = run.optimizer
    if not isinstance(opt, ZeroRedundancyOptimizer):
        return {"sharded": False, "world_size": 1}
    return {"sharded": True, "world_size": opt.world_size,
            "optimizer_class": type(opt.optim).__name__, "format": "consolidated"}


def check_layout(run: Run, saved: dict[str, Any]) -> None:
    """Say when a checkpoint is resharded (it works at any world size: the state is whole)."""
    opt = run.optimizer
    world = opt.world_size if isinstance(opt, ZeroRedundancyOptimizer) else 1
    if saved.get("sharded") and int(saved.get("world_size", world)) != world:
        log.info("zero: optimizer state saved over %s ranks, resharded over %d",
                 saved.get("world_size"), world)
