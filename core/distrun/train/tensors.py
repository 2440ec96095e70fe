"""Small torch helpers for plugins that move nested state (state dicts) between devices."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["to_cpu"]


def to_cpu(value: Any) -> Any:
    """``value`` with every tensor in its dicts and lists detached and copied to the CPU.

    Other values (and tuples) are returned as they are. For state sent to other ranks as
    objects (``broadcast_object_list``), which must not hold device tensors.
    """
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_cpu(v) for v in value]
    return value
