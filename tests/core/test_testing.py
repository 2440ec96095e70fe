"""distrun.testing's helpers fail loudly and fast, as plugin authors rely on."""

from __future__ import annotations

import os
import time

import pytest

from distrun.testing import run_on_ranks


def _sum_ranks(rank, world):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _rank1_raises(rank, world):
    if rank == 1:
        raise ValueError("rank one is unhappy")
    return rank


def _rank1_dies(rank, world):
    if rank == 1:
        os._exit(9)
    return rank


def test_runs_a_real_gloo_group():
    assert run_on_ranks(_sum_ranks, 2, init_process_group=True, timeout=60) == [3.0, 3.0]


def test_a_raising_rank_fails_with_its_traceback():
    with pytest.raises(AssertionError, match="rank 1 failed:(.|\n)*rank one is unhappy"):
        run_on_ranks(_rank1_raises, 2, timeout=60)


def test_a_dead_rank_fails_fast_not_after_the_timeout():
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"ranks \[1\] exited with codes \[9\]"):
        run_on_ranks(_rank1_dies, 2, timeout=600)
    assert time.monotonic() - start < 300
