"""Entry point of distrun-fsdp: the ``fsdp`` strategy and its ``fsdp_*`` options (torch-free)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from distrun import Option, StrategyInfo, hookimpl

if TYPE_CHECKING:
    from distrun.config.run_config import RunConfig
    from distrun.spec.strategy import Strategy

DTYPES = ("keep", "float32", "bfloat16", "float16")


def _make_fsdp(config: RunConfig) -> Strategy:
    from distrun_fsdp.strategy import FSDPStrategy

    return FSDPStrategy(config)


@hookimpl
def distrun_register_strategies(register):
    register(StrategyInfo(
        "fsdp", _make_fsdp, plugin="fsdp",
        help="FSDP2 fully_shard: parameters, gradients and optimizer state sharded over ranks",
    ))


@hookimpl
def distrun_register_options(register):
    def opt(name: str, type_: type, default: object, help_: str, **kw: object) -> None:
        register(Option(name=name, type=type_, default=default, help=help_, plugin="fsdp", **kw))

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
