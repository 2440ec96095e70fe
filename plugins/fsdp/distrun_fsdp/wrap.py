"""Which modules become FSDP units, and ``apply_fsdp``: shard them bottom-up, then the root."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from distrun.plugin import UsageError

__all__ = ["apply_fsdp", "find_blocks", "mixed_precision", "offload_policy"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def find_blocks(model: nn.Module, class_names: Iterable[str] = ()) -> list[nn.Module]:
    """The units to shard before the root, children before their parents.

    With ``class_names``, every module of those classes. Otherwise the model's blocks: the
    children of each ``ModuleList`` and composite children whose class repeats among their
    siblings (``Sequential(Block, Block, ...)``), when they hold parameters.
    """
    names = {n.strip() for n in class_names if n.strip()}
    chosen: set[int] = set()
    if names:
        seen = {type(m).__name__ for m in model.modules()}
        missing = sorted(names - seen)
        if missing:
            raise UsageError(
                f"--fsdp-wrap names {', '.join(missing)} but the model has no module of that "
                f"class (its classes: {', '.join(sorted(seen))})"
            )
        chosen = {id(m) for m in model.modules() if type(m).__name__ in names and m is not model}
    else:
        for parent in model.modules():
            children = list(parent.children())
            counts = Counter(type(c) for c in children)
            for child in children:
                # a repeated *composite* layer is a block; two Linears inside one block are not
                repeated = counts[type(child)] > 1 and next(child.children(), None) is not None
                if (isinstance(parent, nn.ModuleList) or repeated) and _has_params(child) \
                        and not isinstance(child, nn.ModuleList):
                    chosen.add(id(child))
    # modules() is pre-order: reversed, every descendant comes before its ancestors.
    return [m for m in reversed(list(model.modules())) if id(m) in chosen]


def mixed_precision(param_dtype: str, reduce_dtype: str) -> MixedPrecisionPolicy:
    """The policy for ``--fsdp-param-dtype`` / ``--fsdp-reduce-dtype`` ("keep": unchanged)."""
    return MixedPrecisionPolicy(param_dtype=_DTYPES.get(param_dtype),
                                reduce_dtype=_DTYPES.get(reduce_dtype))


def offload_policy(cpu_offload: bool, device: torch.device) -> OffloadPolicy:
    """CPU offload; pinned memory needs an accelerator, so it is pinned only with CUDA."""
    if not cpu_offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device.type == "cuda")


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, *, blocks: list[nn.Module],
               reshard_after_forward: bool = True, **policies: Any) -> nn.Module:
    """``fully_shard`` each block then the root (``policies``: mp_policy, offload_policy).

    The root keeps its parameters gathered after forward (backward needs them first), as
    torchtitan does; blocks follow ``reshard_after_forward``.
    """
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, **policies)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, **policies)
    return model
