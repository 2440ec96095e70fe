"""Rank functions for the contention tests: more ranks than cores, and a slow rank."""

from __future__ import annotations

import os
import time
from typing import Any

import shm_ranks
import torch
import torch.distributed as dist


def pin(cpus: list[int]) -> None:
    """Run this process (and the threads it starts later) on ``cpus`` only."""
    os.sched_setaffinity(0, cpus)


def pinned(rank: int, world: int, cpus: list[int], check: str) -> list[str]:
    """``shm_ranks.<check>`` on ranks that share ``cpus`` (fewer cores than ranks)."""
    pin(cpus)
    return getattr(shm_ranks, check)(rank, world)


def _scheduled_seconds() -> float:
    """Seconds this thread has been on a CPU or queued for one (runnable): not asleep."""
    with open("/proc/thread-self/schedstat") as f:
        on_cpu_ns, queued_ns, _slices = (int(v) for v in f.read().split())
    return (on_cpu_ns + queued_ns) / 1e9


def _compute(seconds: float) -> None:
    """Keep this CPU busy for ``seconds`` (a rank that is late because it is still working)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def slow_peer(rank: int, world: int, cpus: list[int], late: float,
              rounds: int) -> dict[str, Any]:
    """All ranks on ``cpus``; before each collective the last rank is late by ``late`` seconds
    (alternately computing and sleeping). The others return, per collective, the share of the
    wall time they spent runnable (on a CPU or queued for one) rather than asleep, and every
    result is checked."""
    pin(cpus)
    shm_ranks.init_shm(rank, world)
    slow = world - 1
    errors: list[str] = []
    small, big = torch.full((4,), float(rank + 1)), torch.full((300_007,), float(rank + 1))
    total = float(sum(range(1, world + 1)))

    def all_reduce(t: torch.Tensor) -> None:
        t.fill_(rank + 1)
        dist.all_reduce(t)
        if not torch.equal(t, torch.full_like(t, total)):
            errors.append(f"all_reduce of {t.numel()}: {t[:3].tolist()}")

    def broadcast() -> None:
        t = torch.full((1000,), float(rank))
        dist.broadcast(t, src=slow)
        if not torch.equal(t, torch.full((1000,), float(slow))):
            errors.append(f"broadcast: {t[:3].tolist()}")

    def all_gather() -> None:
        outs = [torch.empty(5) for _ in range(world)]
        dist.all_gather(outs, torch.full((5,), float(rank)))
        if [o[0].item() for o in outs] != [float(r) for r in range(world)]:
            errors.append(f"all_gather: {outs}")

    cases = {"all_reduce 16 B": lambda: all_reduce(small),
             "all_reduce 1.2 MB": lambda: all_reduce(big),
             "broadcast": broadcast, "all_gather": all_gather, "barrier": dist.barrier}
    runnable: dict[str, float] = {}
    for name, op in cases.items():
        dist.barrier()
        start, scheduled = time.perf_counter(), _scheduled_seconds()
        for i in range(rounds):
            if rank == slow:
                (_compute if i % 2 == 0 else time.sleep)(late)
            op()
        runnable[name] = (_scheduled_seconds() - scheduled) / (time.perf_counter() - start)
    dist.barrier()
    dist.destroy_process_group()
    return {"errors": errors, "runnable": runnable}
