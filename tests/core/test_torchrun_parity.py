"""`distrun run` as a drop-in for torchrun (issue 15): the environment a script sees under both,
compared variable by variable; torchrun's flags with torchrun's meaning; the run folder rules
(a plain script leaves nothing behind, a run folder is never overwritten); options after a Task
target are run options."""

from __future__ import annotations

import csv
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from distrun.testing import run_cli

DUMP = """
import json, os, sys
out = sys.argv[1]
with open(os.path.join(out, "env%s.json" % os.environ["RANK"]), "w") as fh:
    json.dump(dict(os.environ), fh)
print("hello out from", os.environ["RANK"], flush=True)
print("hello err from", os.environ["RANK"], file=sys.stderr, flush=True)
"""

#: every variable whose value may differ between the launchers, and why
DIFFERENCES = {
    "MASTER_PORT": "a free port, chosen anew by each launch",
    "TORCHELASTIC_RUN_ID": "a fresh id per launch (torchrun: a uuid4; distrun: 12 hex digits)",
    "TORCHELASTIC_ERROR_FILE": "a per-rank error.json in each launcher's own temporary folder",
    "MASTER_ADDR": "torchrun's standalone rendezvous says 'localhost'; distrun binds single-node "
                   "runs to 127.0.0.1 by address (no name lookup, never another interface)",
    "TORCHELASTIC_USE_AGENT_STORE": "under torchrun the agent hosts the store (True); distrun "
                                    "has no agent process on one node: rank 0 hosts the env:// "
                                    "store, so a worker must not look for an agent's (False)",
    "DISTRUN_CONFIG": "distrun only: the launcher's resolved options, for a Task's loop",
    "DISTRUN_LAUNCHER_PID": "distrun only: a worker dies with its launcher (launch.lifeline)",
    "DISTRUN_RUN_KEY": "distrun only: the run's identity for its folder locks, shared by every "
                       "process of the run (launch.folder_lock)",
    "DISTRUN_POSITIONS": "distrun only: where each rank keeps its position record and its "
                         "stack dumps, a folder of the launcher's (diagnose.position)",
    "DISTRUN_BIND_ADDRESS": "distrun only: where the worker's own servers listen (127.0.0.1 "
                            "on one node: launch.binding)",
    "GLOO_SOCKET_IFNAME": "distrun only: gloo's pair sockets on the loopback interface on one "
                          "node (torchrun lets gloo use the address the host name resolves to)",
    "TP_SOCKET_IFNAME": "distrun only: the same for RPC's tensorpipe listeners",
}
#: the variables above that only distrun sets
ONLY_DISTRUN = ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME")


def _envs(folder: Path, n: int = 2) -> list[dict[str, str]]:
    return [json.loads((folder / f"env{r}.json").read_text()) for r in range(n)]


def test_environment_matches_torchrun_variable_by_variable(tmp_path):
    (tmp_path / "dump.py").write_text(DUMP)
    under = {"torchrun": tmp_path / "torchrun", "distrun": tmp_path / "distrun"}
    for d in under.values():
        d.mkdir()
    env = {**os.environ}
    env.pop("OMP_NUM_THREADS", None)  # both launchers set it for 2 processes
    torchrun = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "dump.py",
         str(under["torchrun"])], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=120)
    assert torchrun.returncode == 0, torchrun.stderr
    ours = run_cli("run", "--nproc-per-node", "2", "dump.py", str(under["distrun"]),
                   cwd=tmp_path)
    assert ours.returncode == 0, ours
    for rank, (theirs, mine) in enumerate(zip(_envs(under["torchrun"]), _envs(under["distrun"]))):
        for key in sorted(set(theirs) | set(mine)):
            if key in DIFFERENCES:
                continue
            assert theirs.get(key) == mine.get(key), (rank, key, theirs.get(key), mine.get(key))
        # the ones that differ are there under both (distrun's own two aside)
        for key in DIFFERENCES:
            if not key.startswith("DISTRUN_") and key not in ONLY_DISTRUN:
                assert key in theirs and key in mine, (rank, key)
        assert mine["MASTER_ADDR"] == "127.0.0.1"
        assert mine["TORCHELASTIC_USE_AGENT_STORE"] == "False"
        assert mine["DISTRUN_BIND_ADDRESS"] == "127.0.0.1" and "DISTRUN_STORE_FD" not in mine
        assert mine["TORCHELASTIC_ERROR_FILE"].endswith(f"rank{rank}.error.json")
        for key in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCHELASTIC_SIGNALS_TO_HANDLE",
                    "ROLE_NAME", "OMP_NUM_THREADS"):
            assert mine[key] == theirs[key], key
    # a plain torchrun script leaves nothing behind, as under torchrun; the error files'
    # temporary folder is gone too
    assert sorted(os.listdir(tmp_path)) == ["distrun", "dump.py", "torchrun"]
    assert not os.path.exists(os.path.dirname(mine["TORCHELASTIC_ERROR_FILE"]))
    assert not os.path.exists(mine["DISTRUN_POSITIONS"])


RECORD = """
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    raise ValueError("recorded failure")

main()
"""


def test_record_error_files_land_in_the_log_dir(tmp_path):
    (tmp_path / "rec.py").write_text(RECORD)
    result = run_cli("run", "--log-dir", "logs", "rec.py", cwd=tmp_path)
    assert result.returncode == 1, result
    error = json.loads((tmp_path / "logs" / "rank0.error.json").read_text())
    assert "recorded failure" in error["message"]["message"]
    assert "recorded failure" in (tmp_path / "logs" / "rank0.log").read_text()
    assert sorted(os.listdir(tmp_path)) == ["logs", "rec.py"]  # --log-dir asked: nothing else


def test_torchrun_output_flags(tmp_path):
    (tmp_path / "dump.py").write_text(DUMP)
    # --redirects 1: stdout only into the log files; --local-ranks-filter 1: rank 1 alone on
    # the console; --tee 3: lines prefixed with the rank; torchrun's other spellings accepted.
    result = run_cli("run", "--nproc_per_node", "2", "--redirects", "1", "--log_dir", "logs",
                     "--local-ranks-filter", "1", "--tee", "3", "--role", "trainer",
                     "--standalone", "--start-method", "fork", "--run-path",
                     "--max_restarts", "0", "--monitor-interval", "0.5", "dump.py", ".",
                     cwd=tmp_path)
    assert result.returncode == 0, result
    assert "hello out" not in result.stdout
    assert result.stderr.splitlines() == ["[rank1]: hello err from 1"], result
    log0 = (tmp_path / "logs" / "rank0.log").read_text()
    assert "hello out from 0" in log0 and "hello err from 0" in log0
    envs = _envs(tmp_path)
    assert [e["ROLE_NAME"] for e in envs] == ["trainer", "trainer"]
    assert envs[0]["TORCHELASTIC_ERROR_FILE"] == str(tmp_path / "logs" / "rank0.error.json")


def test_no_python_runs_an_executable(tmp_path):
    exe = tmp_path / "job.sh"
    exe.write_text('#!/bin/sh\necho "rank $RANK of $WORLD_SIZE args $*"\n')
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    result = run_cli("run", "--no_python", "--nproc-per-node", "2", "./job.sh", "a", "--b",
                     cwd=tmp_path)
    assert result.returncode == 0, result
    assert sorted(result.stdout.splitlines()) == ["rank 0 of 2 args a --b",
                                                  "rank 1 of 2 args a --b"]


def test_nproc_per_node_cpu_and_auto(cli, tmp_path):
    from distrun._launch.local import resolve_nproc

    assert resolve_nproc("cpu") == (os.cpu_count() or 1)
    assert resolve_nproc("auto") >= 1
    shown = cli("config", "show", "--json", env={"DISTRUN_NPROC_PER_NODE": "cpu"}, cwd=tmp_path)
    assert json.loads(shown.stdout)["nproc_per_node"]["value"] == "cpu", shown


TASK = """
import torch
import distrun


class T(distrun.Task):
    def configure_model(self):
        return torch.nn.Linear(2, 1)

    def train_data(self):
        g = torch.Generator().manual_seed(0)
        return torch.utils.data.TensorDataset(torch.randn(32, 2, generator=g),
                                              torch.randn(32, 1, generator=g))

    def training_step(self, model, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)


if __name__ == "__main__":
    distrun.fit(T(), batch_size=16, summary=False)
"""


def _steps(run_dir: Path) -> list[tuple[int, int]]:
    with open(run_dir / "metrics.csv", newline="") as fh:
        return [(int(r["epoch"]), int(r["step"])) for r in csv.DictReader(fh) if r["loss"]]


def test_options_after_a_task_target_are_run_options(tmp_path):
    (tmp_path / "task.py").write_text(TASK)
    result = run_cli("-p", "no:progress", "run", "task.py:T", "--max-epochs", "5",
                     "--batch-size", "16", "--log-every-n-steps", "2", "--name", "five",
                     "--no-summary", cwd=tmp_path)
    assert result.returncode == 0, result
    assert _steps(tmp_path / "runs" / "five")[-1] == (4, 10)  # 5 epochs of 2 steps


@pytest.mark.slow
def test_a_run_folder_is_never_overwritten(tmp_path):
    (tmp_path / "task.py").write_text(TASK)
    flags = ("-p", "no:progress", "run", "--no-summary")
    for _ in range(2):
        assert run_cli(*flags, "--name", "r", "task.py:T", cwd=tmp_path).returncode == 0
    again = run_cli(*flags, "--config", "runs/r/config.toml", "task.py:T", cwd=tmp_path)
    assert again.returncode == 0, again
    assert "runs/r holds an earlier run; this run writes runs/r-3" in again.stderr
    assert sorted(os.listdir(tmp_path / "runs")) == ["r", "r-2", "r-3"]
    assert 'name = "r-2"' in (tmp_path / "runs" / "r-2" / "config.toml").read_text()
    # `python task.py` twice: two folders
    for _ in range(2):
        plain = subprocess.run([sys.executable, "task.py"], cwd=tmp_path, capture_output=True,
                               text=True, timeout=120)
        assert plain.returncode == 0, plain.stderr
    assert {"task", "task-2"} <= set(os.listdir(tmp_path / "runs"))
    # continuing the run (--resume auto) is not overwriting: it goes on in the same folder
    cont = run_cli(*flags, "--name", "r", "--resume", "auto", "task.py:T", cwd=tmp_path)
    assert cont.returncode == 0, cont
    assert sorted(p for p in os.listdir(tmp_path / "runs") if p.startswith("r")) == [
        "r", "r-2", "r-3"]
