"""Entry point of distrun-deepspeed: the ``deepspeed`` strategy (torch-free at import)."""

from __future__ import annotations

from distrun.plugin import StrategyInfo, hookimpl
from distrun_deepspeed.options import DeepSpeedOptions, user_config

DISTRUN_PLUGIN_API = 1  # the distrun.plugin API this plugin is written for


@hookimpl
def distrun_register_options(register):
    register(DeepSpeedOptions)


@hookimpl
def distrun_register_strategies(register):
    register(StrategyInfo(
        "deepspeed", "distrun_deepspeed.strategy:DeepSpeedStrategy", plugin="deepspeed",
        help="DeepSpeed's engine with ZeRO stage --ds-stage (1: optimizer state, 2: + "
             "gradients, 3: + parameters sharded over ranks)",
        layout=_layout))


def _layout(config, world_size):
    user_config(config)  # a bad --ds-config file is one line before any worker starts
    return world_size  # every rank is a data-parallel rank


def _engine_strategy(run):
    strategy = run.strategy
    return strategy if getattr(strategy, "name", None) == "deepspeed" else None


@hookimpl(trylast=True)
def distrun_setup_optimizer(run):
    # trylast: after the core built the task's optimizer; DeepSpeed needs both model and
    # optimizer to build its engine, and the loop then runs the engine.
    strategy = _engine_strategy(run)
    if strategy is not None:
        run.model, run.optimizer = strategy.build_engine(run)


@hookimpl
def distrun_load_state_dict(run, state):
    # after the checkpoint plugin restored the weights: DeepSpeed's fp32 master copy follows
    strategy = _engine_strategy(run)
    if strategy is not None:
        strategy.weights_changed()


@hookimpl(trylast=True)  # after --init-weights put its weights in place
def distrun_on_fit_start(run):
    strategy = _engine_strategy(run)
    if strategy is not None:
        strategy.weights_changed()
