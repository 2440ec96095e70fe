"""`distrun run --launcher ray`: ranks as Ray actors on a local cluster started by the tests."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install ray, or tox -e contrib-ray)")
pytest.importorskip("distrun_ray", reason="distrun-ray is not installed (tox -e contrib-ray)")

PROBE = """
import datetime, json, os, sys
import torch, torch.distributed as dist
print(f"hello from rank {os.environ['RANK']}", flush=True)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
t = torch.tensor([float(dist.get_rank())])
dist.all_reduce(t)
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
        "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "MY_VAR"]
info = {k: os.environ.get(k) for k in keys}
info["sum"] = t.item()
info["resume"] = json.loads(os.environ["DISTRUN_CONFIG"])["values"].get("resume", "never")
info["cwd"] = os.getcwd()
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as fh:
    json.dump(info, fh)
dist.destroy_process_group()
"""

#: rank 1 fails on the first attempt only (after saying why); everyone succeeds afterwards
FLAKY = """
import os, sys
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
    print("rank 1 is about to fail", flush=True)
    print("boom: simulated failure", file=sys.stderr, flush=True)
    sys.exit(3)
""" + PROBE


def _ranks(folder: Path, world: int) -> list[dict]:
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)]


def test_two_ray_workers_form_a_gloo_group_and_stream_logs(h, tmp_path, ray_address):
    (tmp_path / "probe.py").write_text(PROBE)
    result = h.distrun("run", "--launcher", "ray", "--ray-address", ray_address,
                     "--ray-num-workers", "2", "--ray-env", "MY_VAR", "--tee",
                     "--name", "probe", "probe.py",
                     str(tmp_path), cwd=tmp_path, env=h.clean_env(MY_VAR="forwarded"))
    assert result.returncode == 0, result.stdout + result.stderr
    infos = _ranks(tmp_path, 2)
    for rank, info in enumerate(infos):
        assert (info["RANK"], info["LOCAL_RANK"], info["WORLD_SIZE"]) == (str(rank), str(rank), "2")
        assert (info["LOCAL_WORLD_SIZE"], info["GROUP_RANK"]) == ("2", "0")  # one Ray node
        assert info["MASTER_ADDR"] == "127.0.0.1" and int(info["MASTER_PORT"]) > 0
        assert info["sum"] == 1.0 and info["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert info["MY_VAR"] == "forwarded" and info["cwd"] == str(tmp_path)
    # the workers' own lines came back through the launcher, tagged with their rank
    lines = result.stdout.splitlines()
    assert "[rank0]: hello from rank 0" in lines and "[rank1]: hello from rank 1" in lines
    # and were kept per rank in the run folder (a plain script has one when asked: --name)
    logs = sorted(p.name for p in (tmp_path / "runs").glob("*/logs/rank*.log"))
    assert logs == ["rank0.log", "rank1.log"]


@pytest.mark.slow
def test_a_run_on_one_ray_node_listens_on_its_address_only(h, tmp_path, ray_cluster):
    """Rank 0's store and gloo's sockets (children of the Ray actors, not of the launcher),
    the launcher's and the head's own: read while the ranks hold."""
    from distrun.testing.sockets import HOLD_SCRIPT, listeners_while_running, listening_sockets

    (tmp_path / "hold.py").write_text(HOLD_SCRIPT)
    hold = tmp_path / "hold"
    hold.mkdir()
    head = []

    def ready() -> bool:
        if not all((hold / f"ready{r}").exists() for r in range(2)):
            return False
        head.extend(listening_sockets(ray_cluster.processes()))
        return True

    listeners, code, output = listeners_while_running(
        [sys.executable, "-m", "distrun", "run", "--launcher", "ray", "--ray-address",
         ray_cluster.address, "--ray-num-workers", "2", "hold.py", str(hold)],
        ready, str(hold / "go"), cwd=tmp_path, env=h.clean_env())
    assert code == 0, output
    every = listeners + head
    workers = {s.pid for s in head if "distrun._worker.main" in s.command}
    assert len(workers) == 2, "\n".join(map(str, every))
    assert all(s.loopback for s in every), "\n".join(map(str, every))


@pytest.mark.slow
def test_a_failure_names_the_rank_and_its_last_lines(h, tmp_path, ray_address):
    (tmp_path / "flaky.py").write_text(FLAKY)
    result = h.distrun("run", "--launcher", "ray", "--ray-address", ray_address,
                     "--ray-num-workers", "2", "flaky.py", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 3, result.stdout + result.stderr
    err = result.stderr
    # its lines were shown as they came: the report is one line naming the rank and node
    assert re.search(r"^distrun: rank 1 \(Ray node 127\.0\.0\.1\) failed with exit code 3: "
                     r".* \(its output is above\)$", err, re.M), err
    # streamed once as it came, then quoted once in the report line
    assert err.splitlines().count("boom: simulated failure") == 1
    assert "restarting" not in err


@pytest.mark.slow
def test_max_restarts_restarts_the_group_with_resume_auto(h, tmp_path, ray_address):
    (tmp_path / "flaky.py").write_text(FLAKY)
    result = h.distrun("run", "--launcher", "ray", "--ray-address", ray_address,
                     "--ray-num-workers", "2", "--ray-max-restarts", "1", "flaky.py",
                     str(tmp_path), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rank 1 (Ray node 127.0.0.1) failed with exit code 3" in result.stderr
    assert "restarting all 2 ranks on Ray (restart 1 of 1)" in result.stderr
    for info in _ranks(tmp_path, 2):  # written by the second attempt only
        assert info["TORCHELASTIC_RESTART_COUNT"] == "1"
        assert info["TORCHELASTIC_MAX_RESTARTS"] == "1"
        assert info["resume"] == "auto" and info["sum"] == 1.0


@pytest.mark.slow
def test_a_cluster_too_small_is_a_usage_error(h, tmp_path, ray_address):
    (tmp_path / "probe.py").write_text(PROBE)
    result = h.distrun("run", "--launcher", "ray", "--ray-address", ray_address,
                     "--ray-num-workers", "9", "--ray-start-timeout", "3", "probe.py",
                     str(tmp_path), cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(
        "error: the Ray cluster cannot place 9 workers of {'CPU': 1.0} within 3s (it has CPU=4")


def test_the_local_launcher_is_untouched(h, tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    result = h.distrun("run", "--launcher", "local", "--nproc-per-node", "2", "probe.py",
                     str(tmp_path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert [i["RANK"] for i in _ranks(tmp_path, 2)] == ["0", "1"]


def test_workers_get_only_the_forwarded_launcher_variables():
    from distrun_ray.launcher import forwarded_env

    environ = {"DISTRUN_CONFIG": "{}", "TORCH_DISTRIBUTED_DEBUG": "INFO", "NCCL_DEBUG": "WARN",
               "OMP_NUM_THREADS": "1", "PYTHONPATH": "/src", "HOME": "/root", "PATH": "/bin",
               "CUDA_VISIBLE_DEVICES": "0", "WANDB_KEY": "k", "MY_VAR": "v"}
    assert forwarded_env(environ, " MY_VAR , WANDB_KEY") == {
        "DISTRUN_CONFIG": "{}", "TORCH_DISTRIBUTED_DEBUG": "INFO", "NCCL_DEBUG": "WARN",
        "OMP_NUM_THREADS": "1", "PYTHONPATH": "/src", "WANDB_KEY": "k", "MY_VAR": "v"}


def test_a_stalled_rank_is_named_once_by_the_ray_launcher(h, tmp_path, ray_address):
    """Each rank's actor watches its rank (the stall watcher, a node service of its group);
    the actors share their reports through the run's store, and the launcher says the line
    once: the rank that hangs, not the one that waits for it."""
    tasks = Path(__file__).resolve().parents[2] / "core"  # (stall_task)
    result = h.distrun("run", "--launcher", "ray", "--ray-address", ray_address,
                       "--ray-num-workers", "2", "--ray-env", "STALL_IN,STALL_MARK",
                       "--stall-timeout", "5", "--timeout", "60", "--batch-size", "16",
                       "--name", "s", "stall_task:StallTask", cwd=tmp_path,
                       env=h.clean_env(PYTHONPATH=os.pathsep.join(
                           [str(tasks), os.environ.get("PYTHONPATH", "")]), STALL_IN="step",
                           STALL_MARK=str(tmp_path / "fault")))
    assert result.returncode == 1, result.stdout + result.stderr
    err = result.stderr
    stall = [ln for ln in err.splitlines() if ln.startswith("error: stall")]
    assert len(stall) == 1, err
    assert re.search(r"^error: stall at step 20: rank 1 \(host \S+, pid \d+\) in training_step "
                     r"for \d+ s at stall_task\.py:\d+ \(time\.sleep\(600\)\); rank 0 in "
                     r"backward for \d+ s; stacks: runs/s/stall-1-rank[01]/$", stall[0]), stall
    assert "failed with exit code" not in err, err  # (the stall ended it, said once)
    assert list((tmp_path / "runs" / "s").glob("stall-1-rank*/rank1.txt")), err
