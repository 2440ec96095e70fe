"""The ddp plugin's options, read typed with ``DdpOptions.of(config)`` (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from distrun.plugin import PluginOptions, option

#: communication hooks ``--ddp-comm-hook`` accepts
COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")


@dataclass(frozen=True)
class DdpOptions(PluginOptions, plugin="ddp"):
    """The ``ddp_*`` options (``DdpOptions.of(config)``)."""

    ddp_bucket_mb: float = option(25.0, "DDP gradient bucket size in MiB", min=0.001)
    ddp_find_unused_parameters: bool = option(
        False, "let DDP tolerate parameters that get no gradient in a step (costs a graph walk)")
    ddp_static_graph: bool = option(
        False, "promise DDP the set of used parameters never changes (enables optimizations)")
    ddp_gradient_as_bucket_view: bool = option(
        True, "gradients are views into the all-reduce buckets: no copy of them back after "
              "each all-reduce, and one gradient's memory less (--no-ddp-gradient-as-bucket-"
              "view: separate gradient tensors, torch's default)")
    ddp_broadcast_buffers: bool = option(
        True, "broadcast module buffers (e.g. BatchNorm stats) from rank 0 at each forward")
    ddp_comm_hook: str = option("none", "gradient communication hook", choices=COMM_HOOKS)
    ddp_powersgd_rank: int = option(1, "PowerSGD matrix approximation rank", min=1)
    ddp_powersgd_start_iter: int = option(
        1000, "PowerSGD: plain all-reduce for this many iterations first (PyTorch's warm-up)",
        min=1)
