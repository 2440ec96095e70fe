"""distrun-rpc on real processes: parameter servers (sync, async batched), RPC + DDP, failures.

Every run is ``distrun run`` in a subprocess with only the rpc plugin loaded (plus the
safetensors plugin for the resume test, when installed). Parity runs compare with the same
task trained by a hand-written one-process loop: a 1-trainer sync parameter server and a
2-trainer async server that averages both pushes per update both follow that SGD trajectory.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time

import pytest

from distrun.testing import run_cli
from distrun.testing.sockets import listeners_of_held_run

HERE = os.path.dirname(__file__)
TASK = os.path.join(HERE, "rpc_task.py")
PLUGINS = "distrun_rpc.plugin"
HAVE_SAFETENSORS = importlib.util.find_spec("distrun_safetensors") is not None
TIMEOUT = 240


def _env(plugins: str = PLUGINS) -> dict[str, str]:
    # Deprecation notices shown (Python hides them outside __main__ by default), so the
    # assertions that torch's RPC notices are filtered mean something.
    return {"DISTRUN_DISABLE_PLUGIN_AUTOLOAD": "1", "DISTRUN_PLUGINS": plugins,
            "PYTHONWARNINGS": "default::DeprecationWarning,default::UserWarning"}


def _run(tmp_path, *flags: str, script_args: tuple[str, ...] = (), name: str = "out",
         plugins: str = PLUGINS):
    out = tmp_path / f"{name}.json"
    env = _env(plugins)
    result = run_cli("run", *flags, "--timeout", "60", "--rpc-timeout", "30", TASK,
                     "--out", str(out), *script_args, cwd=tmp_path, env=env, timeout=TIMEOUT)
    return result, out


def _load(path) -> dict:
    with open(path) as fh:
        return json.load(fh)


@pytest.fixture(scope="module")
def reference() -> dict:
    """The task's final parameters from a hand-written one-process torch loop."""
    spec = importlib.util.spec_from_file_location("rpc_task_ref", TASK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.reference_params()


def _assert_close(got: dict, want: dict, tol: float) -> None:
    import torch

    assert got.keys() == want.keys()
    for key in want:
        a = torch.tensor(got[key])
        diff = (a - want[key]).abs().max().item()
        assert diff <= tol, (key, diff)


def _no_torch_notices(result) -> None:
    assert "is deprecated" not in result.output, result
    assert "as a ProcessGroup" not in result.output, result


def test_sync_two_servers_match_one_process(tmp_path, reference):
    # 1 trainer, parameters sharded over 2 servers; the task's SGD with momentum lives on them.
    result, out = _run(tmp_path, "--nproc-per-node", "3", "--strategy", "rpc",
                       "--rpc-servers", "2")
    assert result.returncode == 0, result
    got = _load(out)
    assert got["role"] == "trainer" and got["world_size"] == 1
    assert "rank 1 is server 0 of 2" in result.stdout and "rank 2 is server 1 of 2" in result.stdout
    assert [s["updates"] for s in got["stats"]] == [len(got["losses"])] * 2  # both shards
    _assert_close(got["params"], reference, tol=1e-5)
    _no_torch_notices(result)


@pytest.mark.slow
def test_an_rpc_run_listens_on_loopback_only(tmp_path):
    """The RPC store, tensorpipe's listeners and gloo's, read while the trainer holds step 1."""
    hold = tmp_path / "hold"
    hold.mkdir()
    listeners, code, output = listeners_of_held_run(
        [sys.executable, "-m", "distrun", "run", "--nproc-per-node", "3", "--strategy", "rpc",
         "--rpc-servers", "2", "--timeout", "60", "--rpc-timeout", "30", TASK,
         "--out", str(tmp_path / "out.json"), "--hold", str(hold)],
        hold, 1, cwd=tmp_path, env=_env(), timeout=TIMEOUT)
    assert code == 0, output
    assert len({s.pid for s in listeners}) == 3, "\n".join(map(str, listeners))  # every rank
    assert all(s.loopback for s in listeners), "\n".join(map(str, listeners))


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    """2 trainers + 1 server, async, both pushes averaged per update; checkpoints at step 8."""
    tmp = tmp_path_factory.mktemp("async")
    ckpt = ("--ckpt-every-n-steps", "8") if HAVE_SAFETENSORS else ()
    plugins = PLUGINS + (",distrun_safetensors.plugin" if HAVE_SAFETENSORS else "")
    result, out = _run(tmp, "--nproc-per-node", "3", "--strategy", "rpc", "--rpc-mode", "async",
                       "--rpc-update-batch", "2", "--run-dir", "run", *ckpt, plugins=plugins)
    return tmp, result, out


@pytest.mark.slow
def test_async_batched_updates_match_one_process(async_run, reference):
    # Each trainer pushes the gradient of half the global batch; the server averages the two
    # pushes per update (--rpc-update-batch 2): the full batch's mean gradient.
    _, result, out = async_run
    assert result.returncode == 0, result
    got = _load(out)
    steps = len(got["losses"])
    assert got["dp_world_size"] == 2 and steps == 16
    assert got["stats"] == [{"updates": steps, "pushes": 2 * steps}]
    _assert_close(got["params"], reference, tol=1e-5)
    _no_torch_notices(result)


@pytest.mark.skipif(not HAVE_SAFETENSORS, reason="needs distrun-safetensors")
@pytest.mark.slow
def test_resume_on_two_servers_restores_parameters_and_momentum(async_run, reference):
    # Resume the 1-server run's step-8 checkpoint with the parameters sharded over 2 servers:
    # parameters and SGD momentum come back by name through the state hooks, so the last 8
    # steps land on the uninterrupted trajectory.
    tmp, first, _ = async_run
    assert first.returncode == 0, first
    step8 = tmp / "run" / "checkpoints" / "step-8"
    assert step8.is_dir(), first
    result, out = _run(tmp, "--nproc-per-node", "4", "--strategy", "rpc", "--rpc-servers", "2",
                       "--rpc-mode", "async", "--rpc-update-batch", "2", "--run-dir", "resumed",
                       "--resume", str(step8), name="resumed",
                       plugins=PLUGINS + ",distrun_safetensors.plugin")
    assert result.returncode == 0, result
    got = _load(out)
    assert "Resumed from" in result.stdout and len(got["losses"]) == 8
    assert got["stats"] == [{"updates": 8, "pushes": 16}] * 2
    _assert_close(got["params"], reference, tol=1e-5)


@pytest.mark.slow
def test_rpc_ddp_remote_embedding_and_dense_ddp(tmp_path):
    result, out = _run(tmp_path, "--nproc-per-node", "3", "--strategy", "rpc",
                       script_args=("--hybrid",))
    assert result.returncode == 0, result
    rank0, rank1 = _load(out), _load(f"{out}.rank1")
    losses = rank0["losses"]
    assert sum(losses[-4:]) / 4 < 0.5 * sum(losses[:4]) / 4, losses
    assert rank0["params"] == rank1["params"]  # the DDP part is bit-identical on both trainers
    assert rank0["remote"] == rank1["remote"]
    assert rank0["stats"][0]["updates"] == 2 * len(losses)  # each trainer stepped the table
    _no_torch_notices(result)


@pytest.mark.slow
def test_dead_trainer_ends_the_run_naming_its_role(tmp_path):
    started = time.monotonic()
    result, _ = _run(tmp_path, "--nproc-per-node", "3", "--strategy", "rpc",
                     script_args=("--die-rank", "1", "--die-step", "3"))
    assert result.returncode == 3, result
    assert "rank 1 failed with exit code 3" in result.stderr, result
    assert "rank 1 is trainer 1 of 2" in result.stderr, result  # the failed rank's role
    assert time.monotonic() - started < TIMEOUT


@pytest.mark.slow
def test_dead_server_ends_the_run_naming_its_role(tmp_path):
    result, _ = _run(tmp_path, "--nproc-per-node", "3", "--strategy", "rpc",
                     script_args=("--kill-server-step", "3"))
    assert result.returncode != 0, result
    reported = ("rank 2 failed with exit code 3" in result.stderr
                and "rank 2 is server 0 of 1" in result.stderr)
    assert reported or "parameter server 0 (rank 2) did not answer" in result.output, result
