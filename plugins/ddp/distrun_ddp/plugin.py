"""Entry point of distrun-ddp: the ``ddp`` strategy and its options (torch-free at import)."""

from __future__ import annotations

from distrun.plugin import StrategyInfo, hookimpl
from distrun_ddp.options import DdpOptions

DISTRUN_PLUGIN_API = 1  # the distrun.plugin API this plugin is written for


@hookimpl
def distrun_register_options(register):
    register(DdpOptions)


@hookimpl
def distrun_register_strategies(register):
    register(StrategyInfo(
        "ddp", "distrun_ddp.strategy:DDPStrategy", plugin="ddp",
        help="DistributedDataParallel: one process per device, gradients all-reduced",
        layout=lambda config, world: world,  # every rank sees its own data
        auto_priority=10,  # --strategy auto on several processes: plain data parallel
    ))
