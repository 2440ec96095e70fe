"""Real `distrun run` launches inside simulated scheduler environments, on this one machine."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from distrun.testing import free_port


def _slurm_task(h, rank: int, port: int) -> dict[str, str]:
    """What srun --ntasks 2 gives task ``rank`` on a one-node allocation called localhost."""
    return h.base_env(SLURM_JOB_ID="5150", SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank),
                    SLURM_NODEID="0", SLURM_NTASKS="2", SLURM_NNODES="1",
                    SLURM_NODELIST="localhost", SLURM_TASKS_PER_NODE="2", MASTER_PORT=str(port))


def test_srun_style_two_tasks_form_one_gloo_group(h, tmp_path, probe):
    """Two launchers (as srun starts them), each runs its one rank in place; ranks meet."""
    port = free_port()
    procs = [h.start("run", str(probe), str(tmp_path), env=_slurm_task(h, r, port), cwd=tmp_path)
             for r in range(2)]
    results = h.finish(procs)
    for code, out in results:
        assert code == 0, out
    infos = h.read_ranks(tmp_path, 2)
    for rank, info in enumerate(infos):
        assert (info["RANK"], info["LOCAL_RANK"], info["WORLD_SIZE"]) == (str(rank), str(rank), "2")
        assert (info["LOCAL_WORLD_SIZE"], info["GROUP_RANK"]) == ("2", "0")
        assert (info["MASTER_ADDR"], info["MASTER_PORT"]) == ("localhost", str(port))
        assert info["group_world"] == 2 and info["sum"] == 1.0  # 0 + 1 over gloo
    # exactly one worker per launcher: no third rank file appeared
    assert sorted(p.name for p in tmp_path.glob("rank*.json")) == ["rank0.json", "rank1.json"]


@pytest.mark.slow
def test_flags_override_detection(h, tmp_path, probe):
    """Inside an srun task, --nproc-per-node chooses the layout and --master-port the port."""
    port = free_port()
    env = _slurm_task(h, 0, 1)  # a port nobody could bind: the flag must win
    result = h.distrun("run", "--nproc-per-node", "2", "--master-port", str(port), str(probe),
                     str(tmp_path), env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    infos = h.read_ranks(tmp_path, 2)
    assert [i["RANK"] for i in infos] == ["0", "1"]
    assert {i["MASTER_PORT"] for i in infos} == {str(port)}
    assert {i["MASTER_ADDR"] for i in infos} == {"localhost"}  # still from the node list


@pytest.mark.slow
def test_pytorchjob_pods_as_two_launchers(h, tmp_path, probe):
    """Two pods of a PyTorchJob (nprocPerNode 1): each launcher starts its pod's worker."""
    port = free_port()
    procs = []
    for pod in range(2):
        env = h.base_env(KUBERNETES_SERVICE_HOST="10.96.0.1", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(pod))
        procs.append(h.start("run", str(probe), str(tmp_path), env=env, cwd=tmp_path))
    for code, out in h.finish(procs):
        assert code == 0, out
    infos = h.read_ranks(tmp_path, 2)
    for pod, info in enumerate(infos):
        assert (info["RANK"], info["GROUP_RANK"], info["GROUP_WORLD_SIZE"]) == (str(pod), str(pod),
                                                                                 "2")
        assert (info["LOCAL_RANK"], info["WORLD_SIZE"]) == ("0", "2")
        assert info["MASTER_PORT"] == str(port) and info["sum"] == 1.0


@pytest.mark.slow
def test_pytorchjob_nproc_per_node_spawns_the_pod_workers(h, tmp_path, probe):
    port = free_port()
    env = h.base_env(KUBERNETES_SERVICE_HOST="10.96.0.1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), WORLD_SIZE="2", RANK="0", PET_NNODES="1",
                   PET_NODE_RANK="0", PET_NPROC_PER_NODE="2")
    result = h.distrun("run", str(probe), str(tmp_path), env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    infos = h.read_ranks(tmp_path, 2)
    assert [(i["RANK"], i["LOCAL_RANK"], i["WORLD_SIZE"]) for i in infos] == [
        ("0", "0", "2"), ("1", "1", "2")]
    assert {i["MASTER_PORT"] for i in infos} == {str(port)} and infos[0]["sum"] == 1.0


@pytest.mark.slow
def test_mpirun_style_ranks(h, tmp_path, probe):
    """Open MPI's variables on one node: per-process, rank 0 on 127.0.0.1."""
    port = free_port()
    procs = []
    for rank in range(2):
        env = h.base_env(OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE="2",
                       OMPI_COMM_WORLD_LOCAL_RANK=str(rank), OMPI_COMM_WORLD_LOCAL_SIZE="2",
                       MASTER_PORT=str(port))
        procs.append(h.start("run", str(probe), str(tmp_path), env=env, cwd=tmp_path))
    for code, out in h.finish(procs):
        assert code == 0, out
    infos = h.read_ranks(tmp_path, 2)
    assert [(i["RANK"], i["LOCAL_RANK"]) for i in infos] == [("0", "0"), ("1", "1")]
    assert {i["MASTER_ADDR"] for i in infos} == {"127.0.0.1"} and infos[1]["sum"] == 1.0


def test_mpi_across_nodes_without_master_addr_is_a_usage_error(h, tmp_path, probe):
    env = h.base_env(OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="4",
                   OMPI_COMM_WORLD_LOCAL_RANK="1", OMPI_COMM_WORLD_LOCAL_SIZE="2")
    result = h.distrun("run", str(probe), str(tmp_path), env=env, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: mpi (open mpi) spans 2 nodes but does not say where rank 0 runs "
        "(export MASTER_ADDR, or pass --master-addr)")


@pytest.mark.slow
def test_under_torchrun_each_worker_runs_its_rank_in_place(h, tmp_path, probe):
    """`torchrun -m distrun run`: TorchElastic started the ranks; the agent hosts the store."""
    import subprocess
    import sys

    port = free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(port), "-m", "distrun", "run", str(probe), str(tmp_path)],
        env=h.base_env(), cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    infos = h.read_ranks(tmp_path, 2)
    assert [(i["RANK"], i["LOCAL_RANK"], i["WORLD_SIZE"]) for i in infos] == [
        ("0", "0", "2"), ("1", "1", "2")]
    assert infos[0]["sum"] == 1.0 and infos[0]["TORCHELASTIC_RUN_ID"] == infos[1][
        "TORCHELASTIC_RUN_ID"]
    assert sorted(p.name for p in tmp_path.glob("rank*.json")) == ["rank0.json", "rank1.json"]


def test_srun_style_tasks_name_the_stalled_rank_of_another_task(h, tmp_path):
    """Each srun task's launcher watches its one rank: a rank that only waits is not the
    culprit, so the tasks share their reports through the run's store (a task is a group of
    its own, even on one node) and each launcher names rank 1, which hangs."""
    port = free_port()
    tasks = Path(__file__).resolve().parents[2] / "core"  # (stall_task)
    procs = [h.start("run", "--stall-timeout", "5", "--timeout", "60", "--batch-size", "16",
                     "--run-dir", str(tmp_path / "run"), "stall_task:StallTask",
                     env=_slurm_task(h, r, port) | {
                         "PYTHONPATH": os.pathsep.join([str(tasks), os.environ.get(
                             "PYTHONPATH", "")]), "STALL_IN": "step",
                         "STALL_MARK": str(tmp_path / "fault")}, cwd=tmp_path)
             for r in range(2)]
    for code, out in h.finish(procs):
        assert code == 1, out
        stall = [ln for ln in out.splitlines() if ln.startswith("error: stall")]
        assert len(stall) == 1, out
        assert re.search(r"^error: stall at step 20: rank 1 \(host \S+, pid \d+\) in "
                         r"training_step for \d+ s at stall_task\.py:\d+ \(time\.sleep\(600\)\);"
                         r" rank 0 in backward for \d+ s; stacks: ", stall[0]), stall


@pytest.mark.slow
def test_a_task_whose_rank_works_long_is_said_busy_by_the_waiting_task_and_the_run_goes_on(
        h, tmp_path):
    """A task's launcher watches its one rank, so it cannot see that rank work while the
    others wait; the waiting task's launcher asks the other task, whose answer says its rank
    works: that is slow, not a stall. Said once, by the waiting task, naming rank 1 and its
    line; nothing ends the run, which finishes once the work does."""
    port = free_port()
    tasks = Path(__file__).resolve().parents[2] / "core"  # (stall_task)
    env = {"PYTHONPATH": os.pathsep.join([str(tasks), os.environ.get("PYTHONPATH", "")]),
           "STALL_IN": "step", "STALL_HOW": "spin", "STALL_FOR": "25",
           "STALL_MARK": str(tmp_path / "fault")}
    procs = [h.start("run", "--stall-timeout", "5", "--timeout", "90", "--batch-size", "16",
                     "--run-dir", str(tmp_path / "run"), "stall_task:StallTask",
                     env=_slurm_task(h, r, port) | env, cwd=tmp_path) for r in range(2)]
    (code0, out0), (code1, out1) = h.finish(procs)
    assert (code0, code1) == (0, 0), out0 + out1
    assert "error: stall" not in out0 + out1, out0 + out1
    busy = [ln for ln in (out0 + out1).splitlines() if ln.startswith("warning: busy")]
    assert len(busy) == 1 and busy[0] in out0, out0 + out1
    assert re.search(r"^warning: busy at step 20: rank 1 \(host \S+, pid \d+\) in training_step "
                     r"for \d+ s at stall_task\.py:\d+ \(.*\); rank 0 in backward for \d+ s "
                     r"\(rank 1 burns CPU while the others wait: .*\); stacks: \S+busy-1-rank0/$",
                     busy[0]), busy
    assert "stall_task.py" in (tmp_path / "run" / "busy-1-rank0" / "rank1.txt").read_text()


def test_distrun_stacks_on_a_node_of_srun_tasks_shows_every_task(h, tmp_path):
    """Two srun tasks' launchers on one node, one live run folder: ``distrun stacks`` asks
    one task's ranks, which ask the other's, and shows both ranks in one line."""
    port = free_port()
    tasks = Path(__file__).resolve().parents[2] / "core"  # (stall_task)
    env = {"PYTHONPATH": os.pathsep.join([str(tasks), os.environ.get("PYTHONPATH", "")]),
           "STALL_IN": "step", "STALL_MARK": str(tmp_path / "fault")}
    procs = [h.start("run", "--stall-timeout", "50", "--timeout", "60", "--batch-size", "16",
                     "--run-dir", str(tmp_path / "run"), "stall_task:StallTask",
                     env=_slurm_task(h, r, port) | env, cwd=tmp_path) for r in range(2)]
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "fault").exists():
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.2)
        time.sleep(1.0)  # (rank 0 reaches its backward's wait)
        looked = h.distrun("stacks", str(tmp_path / "run"), env=h.base_env(), cwd=tmp_path)
    finally:
        for p in procs:
            p.terminate()  # (a user's Ctrl-C: the launchers end their ranks)
        h.finish(procs, timeout=60)
    assert looked.returncode == 0, looked.stdout + looked.stderr
    lines = looked.stdout.strip().splitlines()
    assert len(lines) == 1, looked.stdout
    assert re.search(r"^positions at step 20: rank 1 \(host \S+, pid \d+\) in training_step "
                     r"for \d+ s at stall_task\.py:\d+ \(time\.sleep\(600\)\); rank 0 in "
                     r"backward for \d+ s; stacks: ", lines[0]), lines
