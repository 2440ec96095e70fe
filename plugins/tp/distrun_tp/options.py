"""The tp plugin's options, read typed with ``TpOptions.of(config)`` (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from distrun.plugin import PluginOptions, option


@dataclass(frozen=True)
class TpOptions(PluginOptions, plugin="tp"):
    """The tp plugin's options (``TpOptions.of(config)``)."""

    tp_size: int = option(
        0, "tensor-parallel degree (0: every rank under --strategy tp, else 1); with --strategy "
        "fsdp, a dp x tp mesh",
        min=0)
    tp_sequence_parallel: bool = option(
        False, "automatic plan: also shard norms and activations along the sequence dim in blocks")
    tp_loss_parallel: bool = option(
        False, "shard the output head's logits and compute cross-entropy on the shards")
