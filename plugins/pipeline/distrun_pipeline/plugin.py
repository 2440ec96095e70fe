"""Entry point of distrun-pipeline: the ``pp``, ``pp+ddp`` and ``pp+fsdp`` strategies, their
options and (for runs that use them) the per-step hooks. Torch-free at import."""

from __future__ import annotations

from distrun.plugin import StrategyInfo, hookimpl, plugin_options

DISTRUN_PLUGIN_API = 1  # the distrun.plugin API this plugin is written for

#: --pp-schedule names (see distrun_pipeline.schedules)
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")


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
    opt = plugin_options(register, "pipeline")
    opt("pp", int, 0, "pipeline stages over ranks (0: every rank under --strategy pp; with "
        "pp+ddp / pp+fsdp the world size / N ranks are data parallel)", min=0)
    opt("pp_schedule", str, "1f1b", "the torch.distributed.pipelining schedule",
        choices=SCHEDULES)
    opt("microbatches", int, 0, "micro-batches per step, splitting each rank's batch "
        "(0: 2 x stages)", min=0)
    opt("pp_virtual_stages", int, 2, "stages per rank for interleaved-1f1b and zero-bubble",
        min=1)


@hookimpl
def distrun_setup_strategy(run):
    pipe = getattr(run.strategy, "pipeline_hooks", None)
    if pipe is not None:  # a pipeline strategy: its step, backward and validation hooks
        run.add_hooks(pipe)
        pipe.patch_eval(run.task)
