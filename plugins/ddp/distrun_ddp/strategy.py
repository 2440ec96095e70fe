"""``DDPStrategy``: the model wrapped in DistributedDataParallel, gloo on CPU, nccl on CUDA."""

from __future__ import annotations

import contextlib
import inspect
import logging
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parallel import DistributedDataParallel

from distrun.plugin import BaseStrategy
from distrun_ddp.comm_hooks import register_comm_hook
from distrun_ddp.options import DdpOptions

if TYPE_CHECKING:
    from distrun.plugin import Run

__all__ = ["DDPStrategy"]

log = logging.getLogger("distrun")


class DDPStrategy(BaseStrategy):
    """One process per device; DDP all-reduces gradients during backward."""

    name = "ddp"

    def setup(self, run: Run) -> None:
        super().setup(run)
        if self.world_size == 1:
            log.info("ddp: one process, so the model is not wrapped (nothing to all-reduce)")

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        model = model.to(self.device)
        if not self.distributed:
            return model
        cfg = DdpOptions.of(self.config)
        # Unset, torch's default applies: 25 MiB buckets but a small first one, so the last
        # layers' gradients start their all-reduce while backward is still running. An
        # explicit size (even 25) makes the first bucket that size too.
        bucket_mb = cfg.ddp_bucket_mb if "ddp_bucket_mb" in self.config.sources else None
        hook = cfg.ddp_comm_hook
        if hook == "powersgd":
            bucket_mb = _single_bucket_mb(model, bucket_mb, self.device)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        ddp = DistributedDataParallel(
            model,
            device_ids=device_ids,
            bucket_cap_mb=bucket_mb,
            find_unused_parameters=cfg.ddp_find_unused_parameters,
            static_graph=cfg.ddp_static_graph,
            gradient_as_bucket_view=cfg.ddp_gradient_as_bucket_view,
            **_buffer_sync(cfg.ddp_broadcast_buffers),
        )
        if hook != "none":
            register_comm_hook(ddp, hook, rank=cfg.ddp_powersgd_rank,
                               start_iter=cfg.ddp_powersgd_start_iter)
        return ddp

    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def no_sync(self, model: torch.nn.Module) -> AbstractContextManager[Any]:
        if isinstance(model, DistributedDataParallel):
            return model.no_sync()
        return contextlib.nullcontext()


def _buffer_sync(enabled: bool) -> dict[str, bool]:
    """Per-forward buffer broadcast under the name this torch uses (newer: forward_sync_buffers)."""
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": enabled}
    return {"broadcast_buffers": enabled}


def _single_bucket_mb(model: torch.nn.Module, asked_mb: float | None,
                     device: torch.device) -> float | None:
    """A bucket size that holds every gradient: PowerSGD over gloo needs exactly one bucket."""
    if device.type == "cuda":
        return asked_mb
    total = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    needed = total / 2**20 + 1.0
    if asked_mb is None or needed > asked_mb:
        log.info("ddp: PowerSGD on gloo needs a single gradient bucket; bucket size set "
                 "to %.1f MiB", needed)
        return needed
    return asked_mb
