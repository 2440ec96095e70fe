"""Entry point of distrun-fsdp: the ``fsdp`` strategy and its ``fsdp_*`` options (torch-free)."""

from __future__ import annotations

from typing import Any

from distrun.plugin import ParallelDims, StrategyInfo, hookimpl, plugin_options

DISTRUN_PLUGIN_API = 1  # the distrun.plugin API this plugin is written for

DTYPES = ("keep", "float32", "bfloat16", "float16")


@hookimpl
def distrun_register_strategies(register):
    register(StrategyInfo(
        "fsdp", "distrun_fsdp.strategy:FSDPStrategy", plugin="fsdp",
        help="FSDP2 fully_shard: parameters, gradients and optimizer state sharded over ranks",
        layout=lambda config, world: parallel_dims(config, world).dp,
    ))


def parallel_dims(config: Any, world_size: int) -> ParallelDims:
    """The dp (x tp) degrees of ``world_size`` ranks (torch-free: the launcher checks them)."""
    return ParallelDims.from_world(world_size, tp=int(config.get("tp_size", 1) or 1),
                                   dp_replicate=config.fsdp_replicate_degree)


@hookimpl
def distrun_register_options(register):
    opt = plugin_options(register, "fsdp")
    opt("fsdp_reshard_after_forward", bool, True,
        "free gathered parameters after forward and gather again in backward (less memory)")
    opt("fsdp_wrap", str, "",
        "comma-separated class names to shard as units (default: each block of the model: "
        "children of ModuleLists and repeated layer classes), then the root")
    opt("fsdp_param_dtype", str, "keep", "dtype of gathered parameters in forward/backward",
        choices=DTYPES)
    opt("fsdp_reduce_dtype", str, "keep", "dtype of gradient reduction", choices=DTYPES)
    opt("fsdp_cpu_offload", bool, False,
        "keep sharded parameters, gradients and optimizer state in CPU memory")
    opt("fsdp_replicate_degree", int, 1,
        "HSDP: this many replica groups, each sharding the model over world/N ranks", min=1)
