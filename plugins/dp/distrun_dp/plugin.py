"""Entry point of distrun-dp: the ``dp`` strategy (torch-free at import)."""

from __future__ import annotations

from distrun import StrategyInfo, hookimpl


@hookimpl
def distrun_register_strategies(register):
    register(StrategyInfo(
        "dp", "distrun_dp.strategy:DataParallelStrategy", plugin="dp", multi_process=False,
        help="DataParallel: one process drives every visible GPU (prefer ddp)",
    ))
