"""The rpc plugin's options, read typed with ``RpcOptions.of(config)`` (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from distrun.plugin import PluginOptions, option


@dataclass(frozen=True)
class RpcOptions(PluginOptions, plugin="rpc"):
    """The rpc plugin's options (``RpcOptions.of(config)``)."""

    rpc_servers: int = option(1, "parameter-server ranks (the last ones); the others train", min=1)
    rpc_mode: str = option(
        "sync",
        "sync: distributed autograd + DistributedOptimizer; async: trainers push gradients, "
        "servers batch updates",
        choices=("sync", "async"))
    rpc_update_batch: int = option(
        0, "async: pushed gradients averaged per server update (0: the number of trainers)",
        min=0)
    rpc_timeout: float = option(60.0, "seconds an RPC may take before the run fails", min=1)
