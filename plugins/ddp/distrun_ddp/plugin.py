"""Entry point of distrun-ddp: the ``ddp`` strategy and its options (torch-free at import)."""

from __future__ import annotations

from distrun.plugin import StrategyInfo, hookimpl, plugin_options

DISTRUN_PLUGIN_API = 1  # the distrun.plugin API this plugin is written for

#: communication hooks ``--ddp-comm-hook`` accepts
COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")


@hookimpl
def distrun_register_options(register):
    opt = plugin_options(register, "ddp")
    opt("ddp_bucket_mb", float, 25.0, "DDP gradient bucket size in MiB", min=0.001)
    opt("ddp_find_unused_parameters", bool, False,
        "let DDP tolerate parameters that get no gradient in a step (costs a graph walk)")
    opt("ddp_static_graph", bool, False,
        "promise DDP the set of used parameters never changes (enables optimizations)")
    opt("ddp_gradient_as_bucket_view", bool, False,
        "gradients are views into the all-reduce buckets (saves one gradient copy of memory)")
    opt("ddp_broadcast_buffers", bool, True,
        "broadcast module buffers (e.g. BatchNorm stats) from rank 0 at each forward")
    opt("ddp_comm_hook", str, "none", "gradient communication hook", choices=COMM_HOOKS)
    opt("ddp_powersgd_rank", int, 1, "PowerSGD matrix approximation rank", min=1)
    opt("ddp_powersgd_start_iter", int, 1000,
        "PowerSGD: plain all-reduce for this many iterations first (PyTorch's warm-up)", min=1)


@hookimpl
def distrun_register_strategies(register):
    register(StrategyInfo(
        "ddp", "distrun_ddp.strategy:DDPStrategy", plugin="ddp",
        help="DistributedDataParallel: one process per device, gradients all-reduced",
        layout=lambda config, world: world,  # every rank sees its own data
    ))
