"""The test's own Ray head: a job runs on it, and stopping it leaves no Ray process behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install ray, or tox -e contrib-ray)")
pytest.importorskip("distrun_ray", reason="distrun-ray is not installed (tox -e contrib-ray)")

JOB = """
import datetime, json, os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
if dist.get_rank() == 0:
    with open(sys.argv[1], "w") as fh:
        json.dump({"sum": t.item(), "world": dist.get_world_size(), "pid": os.getpid()}, fh)
dist.destroy_process_group()
"""


def _processes_using(path: str) -> list[int]:
    """Every process on the machine whose command line or open files mention ``path``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as fh:
                if path.encode() in fh.read():
                    found.append(int(name))
                    continue
            fds = os.listdir(f"/proc/{name}/fd")
        except OSError:  # ended meanwhile, or not ours to read
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{name}/fd/{fd}").startswith(path):
                    found.append(int(name))
                    break
            except OSError:
                continue
    return found


@pytest.mark.slow
def test_the_head_is_stopped_with_everything_it_started(h, tmp_path):
    from distrun_ray.local_cluster import LocalRayCluster

    (tmp_path / "job.py").write_text(JOB)
    cluster = LocalRayCluster(num_cpus=2, start_timeout=180)
    address = cluster.start()
    try:
        assert address.startswith("127.0.0.1:")
        result = h.distrun("run", "--launcher", "ray", "--ray-address", address,
                           "--ray-num-workers", "2", "job.py", str(tmp_path / "out.json"),
                           cwd=tmp_path)
        assert result.returncode == 0, result.stdout + result.stderr
        assert json.loads((tmp_path / "out.json").read_text())["sum"] == 3.0
        head = cluster.processes()
        # the head's tree (ray start, GCS, raylet, agents, idle workers) and the job's workers
        # which Ray keeps for reuse hold the cluster's session folder open
        assert len(head) >= 4 and set(_processes_using(cluster.temp_dir)) <= head
        assert _processes_using(cluster.temp_dir)
    finally:
        temp_dir = cluster.temp_dir
        left = cluster.stop()
    assert left == set()
    assert _processes_using(temp_dir) == []  # nothing reparented elsewhere either
    assert not os.path.exists(temp_dir)


@pytest.mark.slow
def test_a_pytest_killed_outright_leaves_no_ray_head(tmp_path):
    """A test run ended by kill -9 (a CI timeout, an OOM kill) runs no fixture teardown: the
    head still ends, every process Ray started with it, within a bound."""
    from distrun._launch.lifeline import pid_alive

    held = tmp_path / "head.json"
    inner = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(Path(__file__).with_name("hold_head.py"))],
        env={**os.environ, "HOLD_HEAD_FILE": str(held)}, cwd=Path(__file__).parents[3],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    head: dict = {"pids": [], "temp_dir": None}
    try:
        deadline = time.monotonic() + 240
        while not held.exists():
            assert inner.poll() is None, f"the inner pytest ended first: exit {inner.returncode}"
            assert time.monotonic() < deadline, "the inner pytest started no head in 240 s"
            time.sleep(0.2)
        head = json.loads(held.read_text())
        assert len(head["pids"]) >= 4, head  # the reaper, ray start, GCS, raylet, agents
        inner.kill()  # SIGKILL: no teardown, no atexit
        inner.wait()
        deadline = time.monotonic() + 30
        while (any(pid_alive(p) for p in head["pids"])
               or _processes_using(head["temp_dir"])) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [p for p in head["pids"] if pid_alive(p)] == []
        assert _processes_using(head["temp_dir"]) == []
        while os.path.exists(head["temp_dir"]) and time.monotonic() < deadline:
            time.sleep(0.2)  # the reaper removes it once the processes are gone
        assert not os.path.exists(head["temp_dir"])
    finally:  # whatever failed above, nothing of that head runs on
        if inner.poll() is None:
            inner.kill()
            inner.wait()
        leftover = set(head["pids"]) | set(
            _processes_using(head["temp_dir"]) if head["temp_dir"] else ())
        for pid in leftover:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if head["temp_dir"]:
            shutil.rmtree(head["temp_dir"], ignore_errors=True)
