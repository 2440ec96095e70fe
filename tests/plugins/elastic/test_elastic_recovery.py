"""Recovery under torch's elastic agent, with real processes on 127.0.0.1.

Every run trains the same tiny task as the reference run (see conftest) and, where the world
size is unchanged, must end with weights bit-identical to it.
"""

from __future__ import annotations

import os
import random
import signal

import pytest
import torch
from elastic_helpers import (
    TASK,
    TRAIN,
    Launcher,
    final_weights,
    plugin_env,
    records,
    steps_trained,
)

from distrun.testing import free_port, run_cli

CKPT_EVERY = 2


def assert_same_weights(rec, reference) -> None:
    got, want = final_weights(rec), final_weights(reference)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name} differs from the uninterrupted run"


def position(start: dict) -> int:
    """Samples trained before this start: 256 per finished epoch plus the cursor."""
    return start["epoch"] * 256 + start["cursor"]


def starts(rec) -> list[dict]:
    """One record per (attempt) start of rank 0."""
    return sorted((e for e in records(rec, "events.jsonl") if e["rank"] == 0),
                  key=lambda e: e["attempt"])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ten_sigkills_in_a_row_each_restart_resumes_bit_identical(tmp_path, reference):
    """One run, ten attempts each ended by SIGKILL of a random rank at a random step.

    Each restart must resume from the newest checkpoint before the kill; the run must finish
    with the reference's weights bit for bit. (One run instead of ten keeps the cost to eleven
    worker-group starts instead of twenty.)
    """
    rng = random.Random(int(os.environ.get("EL_TEST_SEED", "0")) or None)
    kills, step = [], 0
    for attempt in range(10):
        step += rng.randint(1, 3)
        kills.append((attempt, step, rng.randint(0, 1)))
    plan = ",".join(f"{a}:{s}:{r}" for a, s, r in kills)
    rec = tmp_path / "rec"
    result = run_cli("run", "--max-restarts", "10", "--ckpt-every-n-steps", str(CKPT_EVERY),
                     *TRAIN, "--name", "kills", TASK, cwd=tmp_path,
                     env=plugin_env(rec, EL_KILL_PLAN=plan), timeout=880)
    assert result.returncode == 0, f"kill plan {plan}\n{result}"
    assert result.stderr.count("restarting the workers") == 10, result
    got = starts(rec)
    assert [e["attempt"] for e in got] == list(range(11))
    for (attempt, killed_at, _), start in zip(kills, got[1:], strict=True):
        newest = CKPT_EVERY * ((killed_at - 1) // CKPT_EVERY)  # saved before the kill
        assert start["step"] == newest, f"attempt {attempt + 1} of plan {plan}: {start}"
        assert position(start) == newest * 16  # the global sample cursor
    assert_same_weights(rec, reference)


@pytest.mark.slow
def test_kill_during_checkpoint_write_resumes_from_the_previous_one(tmp_path, reference):
    rec = tmp_path / "rec"
    # Rank 0 dies while committing step 6 (files written, folder not yet renamed into place).
    result = run_cli("run", "--max-restarts", "1", "--ckpt-every-n-steps", "3",
                     "--ckpt-keep-last", "0", *TRAIN,
                     "--name", "torn", TASK, cwd=tmp_path, env=plugin_env(rec, EL_CKPT_KILL="0:6"))
    assert result.returncode == 0, result
    ckpts = tmp_path / "runs" / "torn" / "checkpoints"
    second = starts(rec)[1]
    assert second["step"] == 3 and second["resumed_from"].endswith("step-3"), second
    assert "restart 1 of 1" in result.stderr
    assert (ckpts / "step-6").is_dir()  # written again by the resumed run
    assert_same_weights(rec, reference)


@pytest.mark.slow
def test_sigterm_to_launcher_saves_exits_for_requeue_and_relaunch_resumes(tmp_path, reference,
                                                                       busy_cores):
    rec = tmp_path / "rec"
    args = ["--max-restarts", "3", *TRAIN, "--name", "pre", TASK]
    first = Launcher(args, plugin_env(rec, EL_STEP_SLEEP="0.2"), tmp_path, "first")
    try:
        first.wait_until(lambda: len(records(rec, "samples.jsonl")) >= 8, "step 4")
        first.proc.send_signal(signal.SIGTERM)
        code = first.wait(timeout=120)
    finally:
        first.kill_all()
    out = first.output()
    assert code == 143, out
    assert "restarting" not in out and "exit 143 (requeue)" in out
    (stopped,) = [e for e in records(rec, "samples.jsonl") if e["rank"] == 0][-1:]
    saved = tmp_path / "runs" / "pre" / "checkpoints" / f"step-{stopped['step']}"
    assert saved.is_dir(), out  # the preemption checkpoint is the last step trained
    before = steps_trained(rec)

    second = run_cli(*["run", *args], cwd=tmp_path, env=plugin_env(rec))
    assert second.returncode == 0, second
    resumed = starts(rec)[-1]
    assert resumed["step"] == stopped["step"] and position(resumed) == stopped["step"] * 16
    # No step trained twice, none skipped: the two launches together are the reference's steps.
    trained = [r for r in records(rec, "samples.jsonl") if r["rank"] == 0]
    assert len({r["step"] for r in trained}) == len(trained)
    assert steps_trained(rec) == steps_trained(reference)
    assert set(before) == set(range(1, stopped["step"] + 1))
    assert_same_weights(rec, reference)


@pytest.mark.slow
def test_stalled_rank_times_out_and_the_group_restarts(tmp_path, reference):
    rec = tmp_path / "rec"
    train = [a if a != "60" else "8" for a in TRAIN]  # --timeout 8
    # (--stall-timeout 0: the collective's timeout is the path under test; the stall
    # watcher, which names the rank first at its default limit, has its own restart tests)
    result = run_cli("run", "--max-restarts", "1", "--ckpt-every-n-steps", "2", *train,
                     "--stall-timeout", "0", "--name", "stall", TASK, cwd=tmp_path,
                     env=plugin_env(rec, EL_STALL="0:5:1"), timeout=200)
    # Rank 1 sleeps an hour inside step 5: rank 0's all-reduce must fail after 8 s instead.
    assert result.returncode == 0, result
    assert "rank 0 exited with code 1; restarting" in result.stderr, result
    assert starts(rec)[1]["step"] == 4
    assert_same_weights(rec, reference)


@pytest.mark.slow
def test_two_launchers_one_leaves_the_other_continues_alone(tmp_path, reference):
    rec = tmp_path / "rec"
    port = free_port()
    conf = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"
    common = ["--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "pair",
              "--max-restarts", "2", "--ckpt-every-n-steps", "2",
              *[a if a != "2" else "1" for a in TRAIN], TASK]  # one worker per launcher
    # "a" hosts the rendezvous store (it must outlive the run); "b" is the node that leaves.
    host = Launcher(["--rdzv-conf", f"{conf},is_host=true", *common],
                    plugin_env(rec, EL_NODE="a", EL_STEP_SLEEP="0.3"), tmp_path, "a")
    other = Launcher(["--rdzv-conf", f"{conf},is_host=false", *common],
                     plugin_env(rec, EL_NODE="b", EL_STEP_SLEEP="0.3"), tmp_path, "b")
    ckpts = tmp_path / "runs" / "pair" / "checkpoints"
    try:
        host.wait_until(lambda: (ckpts / "step-4").is_dir(), "the checkpoint of step 4")
        # Node b goes away: its launcher and its worker die at once.
        pids = [e["pid"] for e in records(rec, "events.jsonl") if e["node"] == "b"]
        other.kill_all()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        code = host.wait(timeout=240)
    finally:
        host.kill_all()
        other.kill_all()
        other.wait(timeout=30)
    assert code == 0, host.output()
    alone = [e for e in records(rec, "events.jsonl") if e["world"] == 1]
    assert alone and alone[0]["node"] == "a", records(rec, "events.jsonl")
    two = [e for e in records(rec, "events.jsonl") if e["world"] == 2]
    assert {e["node"] for e in two} == {"a", "b"}
    # It continued from the global sample the checkpoint had reached, at world size 1.
    resumed = alone[0]
    assert resumed["step"] >= 4 and position(resumed) == resumed["step"] * 16
    trained = steps_trained(rec)
    assert max(trained) == 36
    want = steps_trained(reference)
    assert all(sorted(trained[s]) == sorted(want[s]) for s in range(1, 37))
