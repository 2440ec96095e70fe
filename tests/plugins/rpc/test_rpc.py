"""distrun-rpc on real processes: parameter servers (sync, async batched), RPC + DDP, failures.

Every run is ``distrun run`` in a subprocess with only the rpc plugin loaded. Parity runs
compare with the same task trained by one process (``--strategy single``): a 1-trainer sync
parameter server and a 2-trainer async server that averages both pushes per update both follow
the single-process SGD trajectory.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from distrun.testing import run_cli

TASK = os.path.join(os.path.dirname(__file__), "rpc_task.py")
ENV = {"DISTRUN_DISABLE_PLUGIN_AUTOLOAD": "1", "DISTRUN_PLUGINS": "distrun_rpc.plugin",
       "PYTHONWARNINGS": "default"}
TIMEOUT = 240


def _run(tmp_path, *flags: str, script_args: tuple[str, ...] = (), name: str = "out"):
    out = tmp_path / f"{name}.json"
    result = run_cli("run", *flags, "--timeout", "60", "--rpc-timeout", "30", TASK,
                     "--out", str(out), *script_args, cwd=tmp_path, env=ENV, timeout=TIMEOUT)
    return result, out


def _load(path) -> dict:
    with open(path) as fh:
        return json.load(fh)


def _assert_close(got: dict, want: dict, tol: float) -> None:
    import torch

    assert got.keys() == want.keys()
    for key in want:
        a, b = torch.tensor(got[key]), torch.tensor(want[key])
        assert torch.allclose(a, b, atol=tol, rtol=0), (key, (a - b).abs().max().item())


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The same task trained by one process: the reference trajectory."""
    tmp = tmp_path_factory.mktemp("single")
    result, out = _run(tmp, "--strategy", "single")
    assert result.returncode == 0, result
    return _load(out)


def _no_torch_notices(result) -> None:
    assert "is deprecated" not in result.output, result
    assert "as a ProcessGroup" not in result.output, result


def test_sync_two_servers_match_one_process(tmp_path, single):
    # 1 trainer, parameters sharded over 2 servers; the task's SGD with momentum lives on them.
    result, out = _run(tmp_path, "--nproc-per-node", "3", "--strategy", "rpc",
                       "--rpc-servers", "2")
    assert result.returncode == 0, result
    got = _load(out)
    assert got["role"] == "trainer" and got["world_size"] == 1
    assert "rank 1 is server 0 of 2" in result.stdout and "rank 2 is server 1 of 2" in result.stdout
    stats = got["stats"]
    assert [s["updates"] for s in stats] == [len(single["losses"])] * 2  # both shards stepped
    _assert_close(got["params"], single["params"], tol=1e-5)
    _no_torch_notices(result)


def test_async_batched_updates_match_one_process(tmp_path, single):
    # 2 trainers each push the gradient of half the global batch; the server averages the two
    # pushes per update (--rpc-update-batch 2), which is the full batch's mean gradient.
    result, out = _run(tmp_path, "--nproc-per-node", "3", "--strategy", "rpc",
                       "--rpc-mode", "async", "--rpc-update-batch", "2")
    assert result.returncode == 0, result
    got = _load(out)
    steps = len(single["losses"])
    assert got["dp_world_size"] == 2 and len(got["losses"]) == steps
    assert got["stats"] == [{"updates": steps, "pushes": 2 * steps}]
    _assert_close(got["params"], single["params"], tol=1e-4)
    _no_torch_notices(result)


def test_rpc_ddp_remote_embedding_and_dense_ddp(tmp_path):
    result, out = _run(tmp_path, "--nproc-per-node", "3", "--strategy", "rpc",
                       script_args=("--hybrid",))
    assert result.returncode == 0, result
    rank0, rank1 = _load(out), _load(f"{out}.rank1")
    losses = rank0["losses"]
    assert sum(losses[-4:]) / 4 < 0.8 * sum(losses[:4]) / 4, losses
    assert rank0["params"] == rank1["params"]  # the DDP part is bit-identical on both trainers
    assert rank0["remote"] == rank1["remote"]
    assert rank0["stats"][0]["updates"] == 2 * len(losses)  # each trainer stepped the table
    _no_torch_notices(result)


def test_dead_trainer_ends_the_run_with_its_role(tmp_path):
    started = time.monotonic()
    result, _ = _run(tmp_path, "--nproc-per-node", "3", "--strategy", "rpc",
                     script_args=("--die-rank", "1", "--die-step", "3"))
    elapsed = time.monotonic() - started
    assert result.returncode != 0, result
    assert "rank 1 failed with exit code 3" in result.stderr, result
    assert "rank 1 is trainer 1 of 2" in result.stderr, result  # the failed rank's role
    assert elapsed < TIMEOUT
