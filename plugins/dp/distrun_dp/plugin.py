"""Entry point of distrun-dp: the ``dp`` strategy (torch-free at import)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distrun import StrategyInfo, hookimpl

if TYPE_CHECKING:
    from distrun.config.run_config import RunConfig


def _make_dp(config: RunConfig) -> Any:
    from distrun_dp.strategy import DataParallelStrategy

    return DataParallelStrategy(config)


@hookimpl
def distrun_register_strategies(register):
    register(StrategyInfo(
        "dp", _make_dp, plugin="dp", multi_process=False,
        help="DataParallel: one process drives every visible GPU (prefer ddp)",
    ))
