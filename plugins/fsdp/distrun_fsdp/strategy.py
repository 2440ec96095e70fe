"""``FSDPStrategy``: FSDP2 ``fully_shard`` over the data-parallel dimensions of a device mesh.

The mesh is ``dp x tp`` (``dp_replicate x dp_shard x tp`` with HSDP), described by
:class:`distrun.plugin.ParallelDims` and published as ``run.stash[keys.DEVICE_MESH]`` and
``strategy.mesh`` so the tp plugin can parallelize the model over ``"tp"`` first (2D).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from distrun.plugin import (
    BaseStrategy,
    build_mesh,
    join_process_group,
    keys,
)
from distrun_fsdp.options import FsdpOptions
from distrun_fsdp.plugin import parallel_dims
from distrun_fsdp.wrap import apply_fsdp, find_blocks, mixed_precision, offload_policy

if TYPE_CHECKING:
    from distrun.plugin import Run, keys

__all__ = ["FSDPStrategy", "clip_grad_norm"]


class FSDPStrategy(BaseStrategy):
    """Shard parameters, gradients and optimizer state over the data-parallel ranks."""

    name = "fsdp"

    def setup(self, run: Run) -> None:
        super().setup(run)
        if self.world_size == 1 and join_process_group():
            self._owns_group = True
        self.dims = parallel_dims(self.config, self.world_size)
        self.mesh: DeviceMesh = build_mesh(self.dims, self.device.type, self.config.timeout)
        coord = dict(zip(self.dims.mesh_dim_names, self.mesh.get_coordinate() or ()))
        self.dp_rank = coord.get("dp", 0) if self.dims.dp_replicate == 1 else \
            coord["dp_replicate"] * self.dims.dp_shard + coord["dp_shard"]
        self.dp_world_size = self.dims.dp
        run.stash[keys.DEVICE_MESH] = self.mesh
        run.stash[keys.PARALLEL_DIMS] = self.dims
        run.log.info("fsdp: %s", self.dims)

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The mesh ``fully_shard`` runs over (2D for HSDP: replicate x shard)."""
        return self.mesh[self.dims.dp_dim_names]

    def wrap_model(self, model: nn.Module) -> nn.Module:
        cfg = FsdpOptions.of(self.config)
        if not cfg.fsdp_cpu_offload:
            model = model.to(self.device)
        blocks = find_blocks(model, cfg.fsdp_wrap.split(",") if cfg.fsdp_wrap else ())
        return apply_fsdp(
            model, self.dp_mesh, blocks=blocks,
            reshard_after_forward=cfg.fsdp_reshard_after_forward,
            mp_policy=mixed_precision(cfg.fsdp_param_dtype, cfg.fsdp_reduce_dtype),
            offload_policy=offload_policy(cfg.fsdp_cpu_offload, self.device),
        )

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Accumulate unsharded gradients locally: no reduce-scatter until the last micro-step."""
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        return clip_grad_norm(model.parameters(), max_norm)


def clip_grad_norm(params: Iterator[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip the global 2-norm of gradients that are DTensors on different meshes (FSDP x TP).

    Each gradient contributes the squared norm of its local shard, summed over the mesh
    dimensions it is sharded on (not those it is replicated on). Returns the total norm.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    total = torch.zeros((), device=grads[0].device)
    # squared local norms grouped by (mesh, sharded mesh dims): one all-reduce per group
    groups: dict[tuple[int, tuple[int, ...]], tuple[DeviceMesh, torch.Tensor]] = {}
    for g in grads:
        if not isinstance(g, DTensor):
            total += g.detach().float().pow(2).sum()
            continue
        sq = g.to_local().detach().float().pow(2).sum()
        sharded = tuple(i for i, p in enumerate(g.placements) if not isinstance(p, Replicate))
        key = (id(g.device_mesh), sharded)
        groups[key] = (g.device_mesh, groups[key][1] + sq if key in groups else sq)
    for (_, dims), (mesh, sq) in groups.items():  # same order on every rank
        for dim in dims:
            dist.all_reduce(sq, group=mesh.get_group(dim))
        total += sq.to(total.device)
    norm = total.sqrt()
    coef = max_norm / (float(norm) + 1e-6)
    if coef < 1.0 and math.isfinite(coef):
        for g in grads:
            g.mul_(coef)
    return norm
