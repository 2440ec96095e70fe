"""The pipeline strategies: ``pp`` (every rank a stage), ``pp+ddp`` and ``pp+fsdp``.

The mesh is ``pp x dp`` (:class:`distrun.plugin.ParallelDims` with a ``pp``
degree). Ranks of one data-parallel replica (one rank per stage) see the same
batch: the first stage reads its inputs, the last its targets. ``wrap_model`` cuts the model
(:mod:`distrun_pipeline.split`), wraps each stage module for data parallelism, builds the
torch ``PipelineStage`` objects and schedule, and returns the *rank view*: the model's own
module tree in which the modules of other ranks' stages hold placeholders (see
:mod:`distrun_pipeline.state`), so ``state_dict`` names are the global ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from distrun.plugin import (
    BaseStrategy,
    ParallelDims,
    UsageError,
    build_mesh,
    keys,
)
from distrun_pipeline import schedules, split, state
from distrun_pipeline.options import PipelineOptions
from distrun_pipeline.pipe import Pipeline, PipelineHooks

if TYPE_CHECKING:
    from distrun.plugin import SetupView, keys

__all__ = ["PipelineDDPStrategy", "PipelineFSDPStrategy", "PipelineStrategy"]


class PipelineStrategy(BaseStrategy):
    """Pipeline stages over ranks; ``dp_mode`` says how the other mesh dimension replicates."""

    name = "pp"
    dp_mode = "none"

    def setup(self, run: SetupView) -> None:
        super().setup(run)
        cfg = self.config
        opts = PipelineOptions.of(cfg)
        pp = opts.pp
        if self.dp_mode == "none":
            pp = pp or self.world_size
            if pp != self.world_size:
                raise UsageError(
                    f"--strategy pp makes every one of the {self.world_size} ranks a stage but "
                    f"--pp is {pp} (use --pp {self.world_size}, or --strategy pp+ddp / pp+fsdp "
                    f"--pp {pp} for data parallel over the other ranks)")
        elif pp == 0:
            raise UsageError(f"--strategy {self.name} needs the number of pipeline stages: "
                             f"--pp N (N divides the world size {self.world_size})")
        if pp < 2:
            raise UsageError(f"pipeline parallel needs at least 2 ranks as stages, got --pp "
                             f"{pp} on {self.world_size} ranks (launch with "
                             "--nproc-per-node 2 or more)")
        # What other plugins add (mixed precision, ZeRO, a tp degree) they check themselves
        # against the layout this strategy publishes (keys.PARALLEL_DIMS, pp > 1).
        self.dims = ParallelDims.from_world(self.world_size, pp=pp)
        self.mesh: DeviceMesh = build_mesh(self.dims, self.device.type, cfg.timeout)
        coord = dict(zip(self.dims.mesh_dim_names, self.mesh.get_coordinate() or (),
                         strict=False))
        self.pp_rank, self.pp_size = coord["pp"], pp
        self.dp_rank, self.dp_world_size = coord["dp"], self.dims.dp
        self.pp_group = self.mesh["pp"].get_group()
        self.dp_mesh = self.mesh["dp"]
        name = opts.pp_schedule
        self.schedule_name = name
        self.v = schedules.virtual_stages(name, opts.pp_virtual_stages)
        self.stages = pp * self.v
        self.microbatches = opts.microbatches or 2 * self.stages
        local = cfg.batch_size // self.dp_world_size if cfg.batch_size % self.dp_world_size == 0 \
            else 0
        if local and local % self.microbatches:
            raise UsageError(
                f"--microbatches {self.microbatches} does not divide the per-rank batch {local} "
                f"(--batch-size {cfg.batch_size} over {self.dp_world_size} data-parallel "
                f"ranks); use a number of micro-batches that divides {local}")
        self.local_batch = local
        self.task = run.task
        self.log = run.log
        run.stash[keys.DEVICE_MESH] = self.mesh
        run.stash[keys.PARALLEL_DIMS] = self.dims
        run.log.info("pp: %s, schedule %s, %d stages, %d micro-batches", self.dims, name,
                     self.stages, self.microbatches)
        self.pipeline: Pipeline | None = None
        self.pipeline_hooks = PipelineHooks(self)

    # -- the model -----------------------------------------------------------------------
    def _stage_mesh(self, pp_rank: int) -> DeviceMesh:
        """The data-parallel ranks of pipeline rank ``pp_rank`` as a 1-D mesh (no groups)."""
        if pp_rank == self.pp_rank:
            return self.dp_mesh
        ranks = self.mesh.mesh[pp_rank].flatten()
        return DeviceMesh(self.device.type, ranks, mesh_dim_names=("dp",), _init_backend=False)

    def wrap_model(self, model: nn.Module) -> nn.Module:
        points = getattr(self.task, "pipeline_split_points", None)
        if callable(points):
            points = points(model)
        chain = split.find_chain(model, points)
        ranges = split.plan(model, chain, self.stages, points)
        where = schedules.placement(self.pp_size, self.v)
        if self.rank == 0:
            self.log.info("pp split (%s):\n%s", "declared" if points else "by parameters",
                          split.split_table(model, chain, ranges, where))
        mine = [s for s in range(self.stages) if where[s] == self.pp_rank]
        trees = [split.stage_tree(model, chain, *ranges[s]) for s in mine]
        owned = {n for s in mine for n in chain.order[slice(*ranges[s])]}
        meshes = {r: self._stage_mesh(r) for r in range(self.pp_size)}
        owner = {n: where[s] for s, (lo, hi) in enumerate(ranges) for n in chain.order[lo:hi]}
        tied = self._tie(model, chain, owner)
        state.place_holders(model, {n: meshes[owner[n]] for n in chain.order if n not in owned},
                            {pid: mesh for pid, (mesh, _, _) in tied.items()})
        for name in [*owned, *chain.shared]:  # only what this rank runs goes to its device
            model.get_submodule(name).to(self.device)
        modules = [self._wrap_stage(m, chain) for m in trees]
        names: dict[int, list[str]] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(n)
        state.shared_state_dict(model, self.dp_mesh, {
            n: mesh for pid, (mesh, _, _) in tied.items() for n in names.get(pid, [])})
        self.pipeline = Pipeline(self, modules, mine, trees)
        held = {id(p): p for p in model.parameters() if not state.is_placeholder(p)}
        self.pipeline.tied = [(held[pid], group, first)
                              for pid, (_, group, first) in tied.items() if pid in held]
        self.tied_meshes = {pid: mesh for pid, (mesh, _, _) in tied.items()}
        return model

    def _tie(self, model: nn.Module, chain: split.Chain,
             owner: dict[str, int]) -> dict[int, tuple[DeviceMesh, Any, bool]]:
        """Parameters used by the modules of stages on several pp ranks (a head tied to the
        token embedding, as GPT-2's): each holding rank keeps it whole, and their gradients
        are summed before the optimizer step (Megatron's way). id -> (the mesh of the ranks
        holding it, their process group, whether this rank counts it in the gradient norm)."""
        users: dict[int, set[int]] = {}
        for name in chain.order:
            for p in model.get_submodule(name).parameters():
                users.setdefault(id(p), set()).add(owner[name])
        out: dict[int, tuple[DeviceMesh, Any, bool]] = {}
        for pid, pp_ranks in users.items():
            if len(pp_ranks) < 2:
                continue
            if self.dp_mode == "fsdp":
                raise UsageError("pipeline: a weight tied across stages (a head tied to the token "
                                 "embedding) does not compose with pp+fsdp; use pp or pp+ddp, or "
                                 "untie it")
            ranks = self.mesh.mesh[sorted(pp_ranks)].flatten()
            group = dist.new_group([int(r) for r in ranks.tolist()])  # every rank calls it
            mesh = DeviceMesh(self.device.type, ranks, mesh_dim_names=("tied",),
                              _init_backend=False)
            out[pid] = (mesh, group, self.pp_rank == min(pp_ranks))
        return out

    def _wrap_stage(self, module: split.StageModule, chain: split.Chain) -> nn.Module:
        if self.dp_mode == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for name in module.names:
                if name in chain.blocks:
                    fully_shard(module.tree.get_submodule(name), mesh=self.dp_mesh,
                                reshard_after_forward=True)
            fully_shard(module, mesh=self.dp_mesh, reshard_after_forward=True)  # in place
            return module
        if self.dp_mode == "ddp" and self.dims.dp > 1:
            from torch.nn.parallel import DistributedDataParallel

            return DistributedDataParallel(module, process_group=self.dp_mesh.get_group())
        return module

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        state.shared_optimizer_state(optimizer, self.dp_mesh, getattr(self, "tied_meshes", {}))
        return optimizer

    def compile_model(self, model: nn.Module) -> None:
        """``--compile``: the schedule runs this rank's stage modules, never the rank view's
        forward, so each stage module is compiled in place (as wrapped for ``pp+ddp`` /
        ``pp+fsdp``); the rank view and its ``state_dict`` names stay as they were."""
        if self.pipeline is None:  # pragma: no cover (the core wraps the model first)
            raise RuntimeError("the pipeline is built when the strategy wraps the model")
        for module in self.pipeline.modules:
            module.compile()

    # -- per step ------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """Nothing: the schedule ran the backward passes inside the training step."""

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm over every stage (and FSDP shard)."""
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        # a weight tied across stages: its (summed) gradient counted once, by its first holder
        twice = {id(p.grad) for p, _, first in self.pipeline.tied if not first} \
            if self.pipeline is not None else set()
        plain = torch.zeros((), device=self.device, dtype=torch.float32)
        sharded = torch.zeros((), device=self.device, dtype=torch.float32)
        for g in [g for g in grads if id(g) not in twice]:
            if isinstance(g, DTensor):
                sharded += g.to_local().detach().float().pow(2).sum()
            else:
                plain += g.detach().float().pow(2).sum()
        if self.dims.dp > 1 and self.dp_mode == "fsdp":
            dist.all_reduce(sharded, group=self.dp_mesh.get_group())
        total = plain + sharded
        dist.all_reduce(total, group=self.pp_group)
        norm = total.sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            (g.to_local() if isinstance(g, DTensor) else g).mul_(coef)
        return norm


class PipelineDDPStrategy(PipelineStrategy):
    """``pp+ddp``: each stage replicated with DDP over its data-parallel ranks."""

    name = "pp+ddp"
    dp_mode = "ddp"


class PipelineFSDPStrategy(PipelineStrategy):
    """``pp+fsdp``: each stage sharded with FSDP2 ``fully_shard`` over its data-parallel ranks."""

    name = "pp+fsdp"
    dp_mode = "fsdp"


