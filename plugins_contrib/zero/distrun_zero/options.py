"""The zero plugin's options, read typed with ``ZeroOptions.of(config)`` (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from distrun.plugin import PluginOptions, option


@dataclass(frozen=True)
class ZeroOptions(PluginOptions, plugin="zero"):
    """The zero plugin's options (``ZeroOptions.of(config)``)."""

    zero: bool = option(
        False,
        "shard the optimizer state across data-parallel ranks (ZeroRedundancyOptimizer; needs "
        "--strategy ddp)")
    zero_bucket_view: bool = option(
        False,
        "ZeRO: pack parameters into contiguous buckets per rank (faster broadcasts, one extra "
        "copy of the parameters)")
