"""``TPStrategy``: a ``"tp"`` device mesh over every rank; the plugin's hook parallelizes.

Every rank of a tensor-parallel group must see the same batch, so the data-parallel view is
one rank (``dp_rank 0 of 1``): the core's sampler then hands all ranks the same samples.
Data parallel x tensor parallel is ``--strategy fsdp --tp-size N``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from distrun.plugin import (
    BaseStrategy,
    build_mesh,
    join_process_group,
    keys,
)
from distrun_tp.plugin import tp_layout

if TYPE_CHECKING:
    from distrun.plugin import Run, keys

__all__ = ["TPStrategy"]


class TPStrategy(BaseStrategy):
    """Tensor parallelism over all ranks; gradients of replicated parameters need no sync."""

    name = "tp"

    def setup(self, run: Run) -> None:
        super().setup(run)
        if self.world_size == 1 and join_process_group():
            self._owns_group = True
        self.dims = tp_layout(self.config, self.world_size)
        self.mesh: DeviceMesh = build_mesh(self.dims, self.device.type, self.config.timeout)
        self.dp_rank, self.dp_world_size = 0, 1
        run.stash[keys.DEVICE_MESH] = self.mesh
        run.stash[keys.PARALLEL_DIMS] = self.dims
        run.log.info("tp: %s", self.dims)

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm; split and replicated parameters mix in one model."""
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        total = torch.zeros((), device=self.device)
        for g in grads:
            norm = g.detach().float().norm()
            if isinstance(norm, DTensor):  # a sharded norm: reduced over the tp group
                norm = norm.full_tensor()
            total += norm * norm
        total = total.sqrt()
        coef = max_norm / (float(total) + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        return total
