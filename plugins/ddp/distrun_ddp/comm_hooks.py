"""DDP communication hooks by name: fp16/bf16 compression and PowerSGD."""

from __future__ import annotations

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

__all__ = ["register_comm_hook"]


def register_comm_hook(ddp: DistributedDataParallel, name: str, *, rank: int = 1,
                       start_iter: int = 1000) -> None:
    """Register the hook ``name`` (fp16, bf16 or powersgd) on ``ddp`` before its first step."""
    if name == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif name == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=rank,
            start_powerSGD_iter=start_iter, min_compression_rate=2,
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    else:  # pragma: no cover - the option's choices are checked by the config
        raise ValueError(f"unknown DDP comm hook {name!r}")
