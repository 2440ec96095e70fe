"""Warm restarts: workers forked from a per-rank spare that has imported torch already.

Each test runs real launchers on 127.0.0.1 and compares a warm run with a cold one
(``--no-warm-restart``) or with the uninterrupted reference run (see conftest).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from elastic_helpers import HERE, TASK, TRAIN, Launcher, final_weights, plugin_env, records

from distrun._launch.lifeline import pid_alive
from distrun.testing import run_cli

ZYGOTE = "distrun._worker.zygote"
#: what differs between two launches whatever starts the workers: ports, ids, file paths
PER_LAUNCH = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE",
              "DISTRUN_LAUNCHER_PID", "DISTRUN_CONFIG", "DISTRUN_RUN_KEY", "DUMP_DIR",
              "DISTRUN_POSITIONS"}


def _dumps(folder: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def _normal(dump: dict, root: Path) -> dict:
    """A dump with what differs between any two launches taken out."""
    out = json.loads(json.dumps(dump).replace(str(root), "<root>"))
    out["env"] = {k: v for k, v in out["env"].items() if k not in PER_LAUNCH}
    out.pop("parent")
    return out


def _dump_run(tmp_path: Path, name: str, *flags: str) -> tuple[dict[str, dict], Path]:
    root = tmp_path / name
    dumps = root / "dumps"
    dumps.mkdir(parents=True)
    result = run_cli("run", "--max-restarts", "1", "--nproc-per-node", "2", *flags,
                     str(HERE / "procdump.py"), cwd=root,
                     env={"DUMP_DIR": str(dumps), "OMP_NUM_THREADS": "1"}, timeout=300)
    assert result.returncode == 0, result
    assert "restarting the workers" in result.stderr, result
    got = _dumps(dumps)
    assert sorted(got) == [f"attempt{a}-rank{r}" for a in (0, 1) for r in (0, 1)], result
    return got, root


def test_a_warm_worker_inherits_exactly_what_a_cold_one_does(tmp_path):
    """Environment, command line, cwd, streams, session, signals: the same, warm or cold."""
    warm, warm_root = _dump_run(tmp_path, "warm")
    cold, cold_root = _dump_run(tmp_path, "cold", "--no-warm-restart")
    for key in warm:
        # a script's first workers start as under torchrun (they need not wait for the spares'
        # preload of torch, torch._dynamo and distrun's loop); its restarts are forked
        assert warm[key]["parent"] == (ZYGOTE if key.startswith("attempt1") else "distrun"), key
        assert cold[key]["parent"] == "distrun", key  # the opt-out: started by the launcher
        assert warm[key]["launcher_is_parent"] and cold[key]["launcher_is_parent"]
        assert warm[key]["threads"] == 1
        assert _normal(warm[key], warm_root) == _normal(cold[key], cold_root), key
    assert warm["attempt1-rank1"]["env"]["TORCHELASTIC_RESTART_COUNT"] == "1"
    assert warm["attempt1-rank1"]["env"]["RANK"] == "1"
    assert warm["attempt1-rank0"]["env"]["LOCAL_RANK"] == "0"


def _train(tmp_path: Path, name: str, plan: str, *flags: str) -> Path:
    rec = tmp_path / name / "rec"
    result = run_cli("run", "--max-restarts", "2", "--ckpt-every-n-steps", "2", *TRAIN,
                     "--name", name, *flags, TASK, cwd=rec.parent,
                     env=plugin_env(rec, EL_KILL_PLAN=plan), timeout=600)
    assert result.returncode == 0, result
    assert result.stderr.count("restarting the workers") == plan.count(",") + 1, result
    return rec


def _assert_same(a: Path, b: Path) -> None:
    got, want = final_weights(a), final_weights(b)
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkilled_workers_restart_warm_and_end_bit_equal_to_cold_restarts(tmp_path, reference):
    plan = "0:5:1,1:9:0"
    warm = _train(tmp_path, "warm", plan)
    cold = _train(tmp_path, "cold", plan, "--no-warm-restart")
    for rec, parent in ((warm, ZYGOTE), (cold, "distrun")):
        starts = sorted((e for e in records(rec, "events.jsonl")),
                        key=lambda e: (e["attempt"], e["rank"]))
        assert [(e["attempt"], e["rank"]) for e in starts] == [
            (a, r) for a in range(3) for r in range(2)]
        assert {e["parent"] for e in starts} == {parent}
        assert [e["step"] for e in starts if e["rank"] == 0] == [0, 4, 8]
        assert [e["generation"] for e in starts if e["rank"] == 0] == [1, 2, 3]
    _assert_same(warm, cold)
    _assert_same(warm, reference)


def _zygotes(launcher: int) -> dict[int, int]:
    """The warm spares below ``launcher``: local rank (their order of start) -> pid."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                argv = fh.read().decode(errors="replace").split("\0")
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
        if ZYGOTE in argv and ppid == launcher:
            found.append(int(entry))
    return dict(enumerate(sorted(found)))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_spare_falls_back_to_a_cold_start_and_leaves_nothing(tmp_path, reference):
    """SIGKILL of rank 1's spare ends its worker with it; the restart starts that rank cold (the
    other warm), the run ends bit-equal to the reference, and no process outlives the run."""
    rec = tmp_path / "rec"
    launcher = Launcher(["--max-restarts", "1", "--ckpt-every-n-steps", "2", *TRAIN,
                         "--name", "spare", TASK], plugin_env(rec, EL_WAIT_AT="0:6"),
                        tmp_path, "spare")
    try:
        launcher.wait_until(lambda: (rec / "waiting").exists(), "rank 0 waiting at step 6")
        spares = _zygotes(launcher.proc.pid)
        assert len(spares) == 2, spares
        first = {e["pid"] for e in records(rec, "events.jsonl")}
        os.kill(spares[1], signal.SIGKILL)
        (rec / "go").touch()
        assert launcher.wait() == 0, launcher.output()
    finally:
        launcher.kill_all()
    out = launcher.output()
    assert "restarting the workers" in out, out
    starts = {(e["attempt"], e["rank"]): e for e in records(rec, "events.jsonl")}
    assert starts[(0, 0)]["parent"] == starts[(0, 1)]["parent"] == ZYGOTE
    assert starts[(1, 0)]["parent"] == ZYGOTE  # its spare lives
    assert starts[(1, 1)]["parent"] == "distrun"  # cold: its spare is gone
    # the newest commit before the kill: step 6's may still be finishing in the background
    assert starts[(1, 0)]["step"] in (4, 6)
    assert starts[(1, 0)]["step"] == starts[(1, 1)]["step"]
    _assert_same(rec, reference)
    pids = [*spares.values(), *first, *(e["pid"] for e in starts.values())]
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if pid_alive(p)], "processes outlived the run"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kill9_of_the_agent_ends_its_spares_and_their_workers(tmp_path):
    """The spares die with the agent, and the workers forked from them with the spares."""
    rec = tmp_path / "rec"
    launcher = Launcher(["--max-restarts", "1", *TRAIN, "--name", "k9", TASK],
                        plugin_env(rec, EL_WAIT_AT="0:3"), tmp_path, "k9")
    try:
        launcher.wait_until(lambda: (rec / "waiting").exists(), "rank 0 waiting at step 3")
        spares = list(_zygotes(launcher.proc.pid).values())
        workers = [e["pid"] for e in records(rec, "events.jsonl")]
        assert len(spares) == 2 and len(workers) == 2, (spares, workers)
        assert all(pid_alive(p) for p in spares + workers)
        os.kill(launcher.proc.pid, signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 30
        while any(pid_alive(p) for p in spares + workers) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        launcher.kill_all()
    assert not [p for p in spares + workers if pid_alive(p)], "outlived the agent by 30 s"
