"""Segments a killed run leaves in /dev/shm (issue 26, item 8): ``distrun shm ls`` tells them
from a live run's, ``distrun shm clean`` removes them, and the creator is known by pid and start
time, so a pid the kernel handed to another process does not keep a segment forever."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from distrun._launch.lifeline import pid_start_time
from distrun.testing import run_cli

#: rank 1 stalls just before it maps the group's segment: rank 0 has created it and waits,
#: the window a kill -9 leaves the name behind in (rank 1 stands for a slow rank)
STALL_BEFORE_MAPPING = """
import os, sys, time
import torch.distributed as dist
from distrun_shm.build import load_extension

ext = load_extension()
create = ext.create


def slow_create(rank, *args, **kwargs):
    if rank != 0:
        open(os.path.join(sys.argv[1], "stalled"), "w").close()
        time.sleep(600)
    return create(rank, *args, **kwargs)


ext.create = slow_create
dist.init_process_group("shm")
"""


def _wait(predicate, what: str, proc: subprocess.Popen | None = None,
          timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc is None or proc.poll() is None, \
            f"the run ended before {what}: exit {proc.returncode}"
        assert time.monotonic() < deadline, f"no {what} within {timeout}s"
        time.sleep(0.05)


def _states(listing: str) -> dict[str, str]:
    """``distrun shm ls``'s lines: segment name -> in use / abandoned."""
    out = {}
    for line in listing.splitlines():
        name, _, rest = line.partition("  ")
        out[name] = "abandoned" if rest.endswith("abandoned") else rest.rpartition("  ")[2]
    return out


def test_a_segment_left_by_a_killed_launcher_is_listed_abandoned_and_cleaned(tmp_path: Path):
    from distrun._launch.lifeline import pid_alive
    from distrun.testing.sockets import process_tree
    from distrun_shm.backend import segment_prefix

    (tmp_path / "stall.py").write_text(STALL_BEFORE_MAPPING)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "distrun", "run", "--nproc-per-node", "2", "--backend", "shm",
         "stall.py", str(tmp_path)], cwd=tmp_path, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"},
        start_new_session=True)
    ours: list[str] = []
    try:
        _wait(lambda: (tmp_path / "stalled").exists(), "a stalled rank 1", launcher)
        tree = process_tree(launcher.pid)
        ours = [n for n in os.listdir("/dev/shm") if n.startswith(segment_prefix())
                and _creator_pid(n) in tree]
        assert len(ours) == 1, ours  # rank 0's, not yet unlinked
        creator = _creator_pid(ours[0])
        # a live run's segment: listed in use, and clean keeps it
        listing = run_cli("shm", "ls")
        assert listing.returncode == 0 and _states(listing.stdout)[ours[0]] == "in use", listing
        kept = run_cli("shm", "clean")
        assert kept.returncode == 0 and os.path.exists(f"/dev/shm/{ours[0]}"), kept
        # kill -9 of the launcher: its ranks die with it, rank 0 before unlinking the name
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        _wait(lambda: not pid_alive(creator), "the end of rank 0", timeout=30)
        assert os.path.exists(f"/dev/shm/{ours[0]}")
        listing = run_cli("shm", "ls")
        assert _states(listing.stdout)[ours[0]] == "abandoned", listing
        cleaned = run_cli("shm", "clean")
        assert cleaned.returncode == 0 and f"removed {ours[0]}" in cleaned.stdout, cleaned
        assert not os.path.exists(f"/dev/shm/{ours[0]}")
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        for name in ours:  # whatever failed above, nothing of this test stays in /dev/shm
            _wait(lambda name=name: not pid_alive(_creator_pid(name)), "the end of rank 0",
                  timeout=30)
            if os.path.exists(f"/dev/shm/{name}"):
                os.unlink(f"/dev/shm/{name}")


def _creator_pid(name: str) -> int:
    from distrun_shm.backend import segment_prefix

    digits = name[len(segment_prefix()):]
    return int(digits[:len(digits) - len(digits.lstrip("0123456789"))] or -1)


def test_a_segment_whose_creator_pid_now_names_another_process_is_abandoned():
    from distrun_shm.backend import leftover_segments, remove_stale_segments, segment_prefix

    me = os.getpid()
    start = int(pid_start_time(me) or 0)
    reused = f"{segment_prefix()}{me}.{start + 1}-0-deadbeef"  # this pid, another process
    live = f"{segment_prefix()}{me}.{start}-0-deadbeef"  # this very process
    for name in (reused, live):
        with open(f"/dev/shm/{name}", "wb") as fh:
            fh.write(b"\0" * 4096)
    try:
        assert reused in leftover_segments() and live not in leftover_segments()
        assert reused in remove_stale_segments()
        assert not os.path.exists(f"/dev/shm/{reused}") and os.path.exists(f"/dev/shm/{live}")
    finally:
        for name in (reused, live):
            if os.path.exists(f"/dev/shm/{name}"):
                os.unlink(f"/dev/shm/{name}")
