"""Small torch helpers for nested values (batches, state dicts): devices and sizes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["batch_len", "to_cpu", "to_device"]


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


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with its tensors (in dicts, lists and tuples) on ``device`` (as is on CPU)."""
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def batch_len(batch: Any) -> int:
    """The number of samples in ``batch``: the first dimension of its first tensor (1 when
    it has none)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)) and batch:
        return batch_len(batch[0])
    return 1
