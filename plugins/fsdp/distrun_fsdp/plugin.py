"""Entry point of distrun-fsdp: the ``fsdp`` strategy and its ``fsdp_*`` options (torch-free)."""

from __future__ import annotations

from typing import Any

from distrun.plugin import ParallelDims, StrategyInfo, hookimpl
from distrun_fsdp.options import FsdpOptions

DISTRUN_PLUGIN_API = 1  # the distrun.plugin API this plugin is written for


@hookimpl
def distrun_register_strategies(register):
    register(StrategyInfo(
        "fsdp", "distrun_fsdp.strategy:FSDPStrategy", plugin="fsdp",
        help="FSDP2 fully_shard: parameters, gradients and optimizer state sharded over ranks",
        layout=lambda config, world: parallel_dims(config, world).dp,
    ))


def parallel_dims(config: Any, world_size: int) -> ParallelDims:
    """The dp (x tp) degrees of ``world_size`` ranks (torch-free: the launcher checks them)."""
    degrees = config.parallel_degrees()  # a tp degree is the tp plugin's fact, not our option
    return ParallelDims.from_world(world_size, tp=degrees.get("tp", 1),
                                   dp_replicate=FsdpOptions.of(config).fsdp_replicate_degree)


@hookimpl
def distrun_register_options(register):
    register(FsdpOptions)
