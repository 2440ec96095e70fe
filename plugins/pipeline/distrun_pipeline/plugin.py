"""Entry point of distrun-pipeline: the ``pp``, ``pp+ddp`` and ``pp+fsdp`` strategies, their
options and (for runs that use them) the per-step hooks. Torch-free at import."""

from __future__ import annotations

from distrun.plugin import StrategyInfo, hookimpl
from distrun_pipeline.options import PipelineOptions

DISTRUN_PLUGIN_API = 1  # the distrun.plugin API this plugin is written for


@hookimpl
def distrun_register_strategies(register):
    register(StrategyInfo(
        "pp", "distrun_pipeline.strategy:PipelineStrategy", plugin="pipeline",
        help="pipeline parallel: the model's blocks split into stages, one per rank"))
    register(StrategyInfo(
        "pp+ddp", "distrun_pipeline.strategy:PipelineDDPStrategy", plugin="pipeline",
        help="pipeline stages (--pp N) x DDP replicas of each stage over the other ranks"))
    register(StrategyInfo(
        "pp+fsdp", "distrun_pipeline.strategy:PipelineFSDPStrategy", plugin="pipeline",
        help="pipeline stages (--pp N) x FSDP2 sharding of each stage over the other ranks"))


@hookimpl
def distrun_register_options(register):
    register(PipelineOptions)


@hookimpl
def distrun_setup_strategy(run):
    pipe = getattr(run.strategy, "pipeline_hooks", None)
    if pipe is not None:  # a pipeline strategy: its step, backward and validation hooks
        run.add_hooks(pipe)
        pipe.patch_eval(run.task)
