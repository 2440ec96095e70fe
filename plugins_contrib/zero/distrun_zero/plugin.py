"""Entry point of distrun-zero: ZeroRedundancyOptimizer for DDP runs (torch-free at import)."""

from __future__ import annotations

from distrun.plugin import UsageError, hookimpl, keys
from distrun_zero.options import ZeroOptions

DISTRUN_PLUGIN_API = 1  # the distrun.plugin API this plugin is written for


@hookimpl
def distrun_register_options(register):
    register(ZeroOptions)


@hookimpl(trylast=True)
def distrun_setup_optimizer(run):
    # trylast: after the core built the task's optimizer and the strategy wrapped it.
    if ZeroOptions.of(run.config).zero:
        if getattr(run.task, "automatic_optimization", True) is False:
            count = len(getattr(run.optimizer, "optimizers", None) or [run.optimizer])
            several = f" with {count} optimizers" if count > 1 else ""
            raise UsageError(
                f"--zero shards the one optimizer the loop steps, but {type(run.task).__name__} "
                f"steps its optimizers itself (automatic_optimization = False{several}); drop "
                "--zero (--strategy fsdp shards every optimizer's state)")
        dims = run.stash.get(keys.PARALLEL_DIMS)
        if dims is not None and dims.pp > 1:
            raise UsageError("--zero does not compose with pipeline parallel (see the "
                             "composition table in docs/strategies.md); drop it, or use "
                             "pp+fsdp to shard each stage")
        from distrun_zero.zero import shard_optimizer

        shard_optimizer(run)


@hookimpl
def distrun_state_dict(run):
    if ZeroOptions.of(run.config).zero:
        from distrun_zero.zero import layout

        return {"zero": layout(run)}
    return None


@hookimpl
def distrun_load_state_dict(run, state):
    if ZeroOptions.of(run.config).zero and "zero" in state:
        from distrun_zero.zero import check_layout

        check_layout(run, state["zero"])
