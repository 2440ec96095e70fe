"""Entry point of distrun-dp: the ``dp`` strategy (torch-free at import)."""

from __future__ import annotations

from distrun.plugin import StrategyInfo, hookimpl

DISTRUN_PLUGIN_API = 1  # the distrun.plugin API this plugin is written for


@hookimpl
def distrun_register_strategies(register):
    register(StrategyInfo(
        "dp", "distrun_dp.strategy:DataParallelStrategy", plugin="dp", multi_process=False,
        help="DataParallel: one process drives every visible GPU (prefer ddp)",
    ))
