"""Small object collectives that also work without a process group (one process)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["agree", "broadcast", "gather", "rank_world"]


def active(group: Any = None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def broadcast(obj: Any, group: Any = None) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not active(group):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0,
                               group=group)
    return box[0]


def gather(obj: Any, group: Any = None) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (None elsewhere)."""
    if not active(group):
        return [obj]
    me = dist.get_rank(group)
    out: list[Any] | None = [None] * dist.get_world_size(group) if me == 0 else None
    dist.gather_object(obj, out, dst=dist.get_global_rank(group, 0) if group else 0,
                       group=group)
    return out


def agree(error: Any, group: Any = None) -> Any:
    """The first rank's error (a message, or any picklable value) if any rank has one, the
    same on every rank; None when none has."""
    if not active(group):
        return error
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, error, group=group)
    return next((e for e in out if e), None)
