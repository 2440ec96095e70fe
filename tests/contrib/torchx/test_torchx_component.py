"""The ``distrun.run`` TorchX component, run by the real ``torchx`` on its local_cwd scheduler."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchx", reason="TorchX is not installed (pip install distrun-torchx)")
pytest.importorskip("distrun_torchx", reason="distrun-torchx is not installed")

TASK = """
import json, sys
import torch
import distrun


class Regress(distrun.Task):
    def configure_model(self):
        return torch.nn.Linear(4, 1)

    def configure_optimizer(self, params):
        return torch.optim.SGD(params, lr=0.05)

    def train_data(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 4, generator=g)
        return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))

    def training_step(self, model, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)


class Report:
    @distrun.hookimpl
    def distrun_on_fit_end(self, run):
        if run.is_global_zero:
            weights = [p.detach().flatten().tolist() for p in run.unwrapped_model().parameters()]
            with open(sys.argv[1], "w") as fh:
                json.dump({"world": run.world_size, "step": run.progress.step,
                           "weights": weights}, fh)


if __name__ == "__main__":
    distrun.Trainer(plugins=(Report(),)).fit(Regress())
"""

FAIL = """
import os, sys
if os.environ["RANK"] == "1":
    print("rank 1 gives up", file=sys.stderr, flush=True)
    sys.exit(3)
"""

#: the TorchX runner API in a child process (local_cwd runs the job in the caller's cwd)
STATUS = """
import json, sys
from torchx.runner import get_runner

with get_runner() as runner:
    handle = runner.run_component("distrun.run", sys.argv[2:], scheduler="local_cwd",
                                  cfg={"log_dir": sys.argv[1]})
    status = runner.wait(handle, wait_interval=0.5)
    print("STATUS " + json.dumps({"handle": handle, "state": status.state.name}))
"""

TRAIN = ["--strategy", "ddp", "--run_args", "--max-steps 6 --batch-size 8 --no-summary"]
SKIP_SCHEDULERS = ("SLURM_", "OMPI_", "PMI_", "TORCHELASTIC_", "PET_", "RAY_ADDRESS")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(SKIP_SCHEDULERS)}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _torchx(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    """``torchx ARGS`` in ``cwd``; a ``run`` keeps its replicas' logs in ``cwd/logs``. One
    still running after ``timeout`` seconds is stopped with every replica it started, and the
    test fails with what the replicas printed (CI once saw the two-node run hang, silently)."""
    torchx = str(Path(sys.executable).parent / "torchx")
    if args[:1] == ("run",):
        args = ("run", "-cfg", f"log_dir={cwd / 'logs'}", *args[1:])
    proc = subprocess.Popen([torchx, *args], cwd=cwd, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchx and the replicas it runs as children
        out, err = proc.communicate()
        pytest.fail(f"torchx {' '.join(args)} still running after {timeout:.0f} s\n"
                    f"{out}{err}{_replica_logs(cwd)}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _replica_logs(cwd: Path) -> str:
    """What each replica printed (TorchX's logs) and each worker's stderr (distrun's)."""
    paths = [*sorted((cwd / "logs").rglob("combined.log")),
             *sorted((cwd / "runs").rglob("stderr.log"))]
    return "".join(f"\n--- {path.relative_to(cwd)}:\n{path.read_text()[-3000:]}"
                   for path in paths)


def _runner(*component_args: str, cwd: Path) -> tuple[dict, subprocess.CompletedProcess]:
    (cwd / "status.py").write_text(STATUS)
    proc = subprocess.run([sys.executable, "status.py", str(cwd / "logs"), *component_args],
                          cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("STATUS ")), None)
    assert line, proc.stdout + proc.stderr
    return json.loads(line[7:]), proc


@pytest.fixture
def reference(tmp_path) -> dict:
    """The same job under plain `distrun run --nproc-per-node 2`."""
    (tmp_path / "task.py").write_text(TASK)
    proc = subprocess.run([sys.executable, "-m", "distrun", "run", "--nproc-per-node", "2",
                           "--strategy", "ddp", "--max-steps", "6", "--batch-size", "8",
                           "--no-summary", "--name", "ref", "task.py", str(tmp_path / "ref.json")],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((tmp_path / "ref.json").read_text())


def test_torchx_run_trains_two_processes_and_succeeds(tmp_path, reference):
    result = _torchx("run", "-s", "local_cwd", "distrun.run", "--nproc_per_node", "2", *TRAIN,
                     "--script", "task.py", "tx.json", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Job finished: SUCCEEDED" in result.stderr
    got = json.loads((tmp_path / "tx.json").read_text())
    assert got["world"] == 2 and got["step"] == reference["step"] == 6
    assert got["weights"] == reference["weights"]  # CPU, fixed seed: bit-equal
    # the run folder is named after the TorchX app id (printed as the app handle)
    handle = next(ln for ln in result.stdout.splitlines() if ln.startswith("local_cwd://"))
    assert (tmp_path / "runs" / handle.rsplit("/", 1)[1]).is_dir()


@pytest.mark.slow
def test_the_runner_api_reads_succeeded_back(tmp_path, reference):
    status, proc = _runner("--nproc_per_node", "2", *TRAIN, "--script", "task.py", "api.json",
                           cwd=tmp_path)
    assert status["state"] == "SUCCEEDED", proc.stdout + proc.stderr
    assert status["handle"].startswith("local_cwd://torchx/task-")
    assert json.loads((tmp_path / "api.json").read_text())["weights"] == reference["weights"]


@pytest.mark.slow
def test_a_failing_script_is_reported_failed(tmp_path):
    (tmp_path / "fail.py").write_text(FAIL)
    status, proc = _runner("--nproc_per_node", "2", "--script", "fail.py", cwd=tmp_path)
    assert status["state"] == "FAILED", proc.stdout + proc.stderr
    app_id = status["handle"].rsplit("/", 1)[1]
    # distrun's one-line failure report is in the replica's log that TorchX kept
    stderr = (tmp_path / "logs" / "torchx" / app_id / "fail" / "0" / "stderr.log").read_text()
    assert "rank 1 gives up" in stderr
    assert "distrun: rank 1 failed with exit code 3" in stderr, stderr
    result = _torchx("run", "-s", "local_cwd", "distrun.run", "--nproc_per_node", "2",
                     "--script", "fail.py", cwd=tmp_path)
    assert result.returncode == 1 and "state: FAILED" in result.stderr, result.stderr


@pytest.mark.slow
def test_two_nodes_meet_through_c10d_rendezvous(tmp_path, reference):
    """Two replicas of one distrun launcher each: torch's c10d store on replica 0's host."""
    from distrun.plugin import free_port

    result = _torchx("run", "-s", "local_cwd", "distrun.run", "--nnodes", "2",
                     "--nproc_per_node", "1", "--rdzv_port", str(free_port()), *TRAIN,
                     "--script", "task.py", "nodes.json", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    got = json.loads((tmp_path / "nodes.json").read_text())
    assert got["world"] == 2 and got["weights"] == reference["weights"]


def test_the_appdef_carries_the_knobs():
    from torchx import specs

    from distrun_torchx.components import run

    app = run("--lr", "3e-4", script="train.py", nnodes="2", nproc_per_node=4, strategy="fsdp",
              run_args="--max-steps 100 --resume auto", image="registry/img:1", cpu=8, gpu=4,
              memMB=32000, env={"NCCL_DEBUG": "WARN"}, max_retries=3, rdzv_port=29600,
              mounts=["type=bind", "src=/data", "dst=/data"])
    (role,) = app.roles
    assert app.name == "train" and role.name == "train" and role.image == "registry/img:1"
    assert (role.num_replicas, role.min_replicas, role.max_retries) == (2, None, 3)
    assert (role.resource.cpu, role.resource.gpu, role.resource.memMB) == (8, 4, 32000)
    assert role.port_map == {"c10d": 29600} and role.env["NCCL_DEBUG"] == "WARN"
    assert role.mounts[0].dst_path == "/data"
    assert role.entrypoint == "bash" and role.args == [
        "-c", "distrun run --nproc-per-node 4 --strategy fsdp --name '${app_id}' --nnodes 2 "
        "--rdzv-backend c10d --rdzv-endpoint ${${rank0_env}:=localhost}:29600 "
        "--rdzv-id '${app_id}' --max-steps 100 --resume auto train.py --lr 3e-4"]
    one = run(script="task.py:Regress", name="exp")
    assert one.name == "exp" and one.roles[0].args[1] == (
        "distrun run --nproc-per-node 1 --strategy auto --name '${app_id}' task.py:Regress")
    elastic = run(script="t.py", nnodes="1:4").roles[0]
    assert (elastic.min_replicas, elastic.num_replicas) == (1, 4)
    assert isinstance(app, specs.AppDef)
    with pytest.raises(ValueError, match="nnodes must be N or MIN:MAX"):
        run(script="t.py", nnodes="two")


def test_torchx_finds_the_component_and_keeps_its_builtins(tmp_path):
    result = _torchx("builtins", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    names = {ln.split(". ", 1)[1].strip() for ln in result.stdout.splitlines() if ". " in ln}
    assert {"distrun.run", "dist.ddp", "utils.echo"} <= names
