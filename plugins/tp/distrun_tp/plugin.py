"""Entry point of distrun-tp: the ``tp`` strategy, ``tp_*`` options and the TP hooks.

Torch-free at import. The ``distrun_setup_model`` implementation is plain (not trylast), so it
runs before the core lets the strategy wrap the model: under ``--strategy fsdp --tp-size N``
the model is parallelized over the mesh's ``"tp"`` dimension first, then sharded over ``"dp"``.
"""

from __future__ import annotations

from typing import Any

from distrun.plugin import (
    ParallelDims,
    StrategyInfo,
    UsageError,
    hookimpl,
    keys,
)
from distrun_tp.options import TpOptions

DISTRUN_PLUGIN_API = 1  # the distrun.plugin API this plugin is written for


@hookimpl
def distrun_register_strategies(register):
    register(StrategyInfo(
        "tp", "distrun_tp.strategy:TPStrategy", plugin="tp",
        help="tensor parallel: layers split over ranks with parallelize_module (same data)",
        layout=lambda config, world: tp_layout(config, world).dp,
    ))


def tp_layout(config: Any, world_size: int) -> ParallelDims:
    """``--strategy tp``'s degrees: every rank in one tensor-parallel group (torch-free: the
    launcher checks them before any worker starts, the strategy again in each worker)."""
    tp = TpOptions.of(config).tp_size or world_size
    if tp != world_size:
        if world_size % tp:
            hint = f"use --tp-size {world_size}"
        else:
            hint = (f"use --tp-size {world_size}, or --strategy fsdp --tp-size {tp} for "
                    f"{world_size // tp}-way data parallel x {tp}-way tensor parallel")
        raise UsageError(f"--strategy tp splits layers over all {world_size} ranks but "
                         f"--tp-size is {tp} ({hint})")
    return ParallelDims.from_world(world_size, tp=tp)


@hookimpl
def distrun_register_options(register):
    register(TpOptions)


@hookimpl
def distrun_parallel_degrees(config):
    tp = TpOptions.of(config).tp_size
    return {"tp": tp} if tp else None


def _tp_mesh(run: Any) -> Any:
    mesh = run.stash.get(keys.DEVICE_MESH)
    if mesh is None or "tp" not in (mesh.mesh_dim_names or ()):
        return None
    return mesh["tp"]


@hookimpl
def distrun_setup_model(run):
    tp_mesh = _tp_mesh(run)
    opts = TpOptions.of(run.config)
    wanted = opts.tp_size
    # A mesh may carry a 'tp' dimension of 1 (a pipeline's pp x dp x tp): the degree asked
    # for must be the mesh's, or --tp-size would be quietly ignored.
    if wanted > 1 and (tp_mesh is None or tp_mesh.size() != wanted):
        raise UsageError(
            f"--tp-size {wanted} needs a strategy that builds a device mesh with a 'tp' "
            f"dimension of that size (--strategy tp, or --strategy fsdp for dp x tp); "
            f"'{run.strategy.name}' does not"
        )
    if tp_mesh is None or tp_mesh.size() == 1:
        return
    from distrun_tp.parallelize import parallelize

    run.model = parallelize(run.model.to(run.device), tp_mesh, run.task, opts, run.log,
                            verbose=run.is_global_zero)
    if opts.tp_loss_parallel:
        run.add_hooks(LossParallel())


class LossParallel:
    """``--tp-loss-parallel``: steps and validation under torch's ``loss_parallel`` context
    (registered for the fit only when it applies: other runs' steps never pass here)."""

    @hookimpl(wrapper=True)
    def distrun_training_step(self, run, batch):
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            loss = yield
        # a replicated DTensor scalar: hand the loop a plain tensor (autograd goes through)
        return loss.to_local() if isinstance(loss, DTensor) else loss

    @hookimpl(wrapper=True)
    def distrun_backward(self, run, loss):
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            return (yield)

    @hookimpl(wrapper=True)
    def distrun_run_validation(self, run):
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            return (yield)
