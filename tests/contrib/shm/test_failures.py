"""A rank that dies, raises or stalls makes the others fail with a clear error, never hang;
/dev/shm keeps nothing of ours (the conftest checks after every test)."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import re
import subprocess
import sys

import pytest

from distrun.testing import free_port, run_on_ranks

sys.path.insert(0, os.path.dirname(__file__))
import shm_ranks  # noqa: E402


def _spawn(how: str, world: int = 2) -> tuple[dict[int, str], list[int | None]]:
    """Rank 1 fails as ``how`` says; the results reported and each rank's exit code. When a
    result is missing, ``results["seen"]`` lists every message that did arrive."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = []
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # what the spawned ranks inherit; restored below
    try:
        for rank in range(world):
            procs.append(ctx.Process(target=shm_ranks.failing_rank,
                                     args=(rank, world, how, queue)))
            procs[-1].start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    results: dict = {}
    seen: list = []
    try:
        while len(results) < (1 if how in ("kill", "exception") else world):
            kind, rank, *rest = queue.get(timeout=90)
            seen.append((kind, rank, *rest))
            if kind == "result":
                results[rank] = rest[0]
    except queue_mod.Empty:
        results["seen"] = seen
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
            p.join()
    return results, [p.exitcode for p in procs]


@pytest.mark.parametrize("how", ["kill", "exception"])
def test_dead_rank_fails_the_others(how):
    results, codes = _spawn(how)
    assert codes[1] == (-9 if how == "kill" else 3)
    assert re.match(r"DistBackendError: shm backend: rank 1 of the group \(pid \d+\) exited "
                    r"during allreduce$", results[0]), results


@pytest.mark.slow
def test_stalled_rank_times_out_and_the_late_one_is_told():
    results, codes = _spawn("stall")
    assert results[0] == ("DistBackendError: shm backend: allreduce timed out after 3.0 s "
                          "waiting for rank 1 of the group"), results
    assert results[1].startswith("DistBackendError: shm backend: allreduce failed because "
                                 "rank 0 of the group gave up ("), results


def test_stale_segment_of_a_killed_run_is_removed_at_next_start():
    from distrun_shm.backend import segment_prefix

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that has ended: its segments are stale
    stale = f"/dev/shm/{segment_prefix()}{dead.pid}-0-deadbeef"
    with open(stale, "wb") as f:
        f.write(b"\0" * 4096)
    pids = run_on_ranks(_init_and_pid, 2, timeout=60)
    assert not os.path.exists(stale)
    assert all(pid != dead.pid for pid in pids)


def _init_and_pid(rank: int, world: int) -> int:
    shm_ranks.init_shm(rank, world)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    return os.getpid()



@pytest.mark.slow
def test_dead_rank_detected_under_load(busy_cores):
    # every core busy: waiting ranks sleep on the futex and still see the peer's death
    results, codes = _spawn("kill")
    assert codes[1] == -9
    assert "exited during allreduce" in results[0], results


@pytest.mark.slow
def test_mesh_and_subgroups_under_load(busy_cores):
    for errors in run_on_ranks(shm_ranks.check_subgroups_and_mesh, 4, timeout=120):
        assert errors == []
