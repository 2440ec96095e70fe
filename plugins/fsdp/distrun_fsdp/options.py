"""The fsdp plugin's options, read typed with ``FsdpOptions.of(config)`` (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from distrun.plugin import PluginOptions, option

DTYPES = ("keep", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class FsdpOptions(PluginOptions, plugin="fsdp"):
    """The fsdp plugin's options (``FsdpOptions.of(config)``)."""

    fsdp_reshard_after_forward: bool = option(
        True, "free gathered parameters after forward and gather again in backward (less memory)")
    fsdp_wrap: str = option(
        "", "comma-separated class names to shard as units (default: each block of the model: "
        "children of ModuleLists and repeated layer classes), then the root")
    fsdp_param_dtype: str = option(
        "keep", "dtype of gathered parameters in forward/backward",
        choices=DTYPES)
    fsdp_reduce_dtype: str = option("keep", "dtype of gradient reduction", choices=DTYPES)
    fsdp_cpu_offload: bool = option(
        False, "keep sharded parameters, gradients and optimizer state in CPU memory")
    fsdp_replicate_degree: int = option(
        1, "HSDP: this many replica groups, each sharding the model over world/N ranks",
        min=1)
