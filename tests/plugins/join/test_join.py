"""Uneven inputs finish: Join for DDP, agreed step counts otherwise, a clear error without."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from distrun.testing import run_cli, run_on_ranks

sys.path.insert(0, os.path.dirname(__file__))  # join_tasks, importable by spawned ranks too
from join_tasks import fit_uneven  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "uneven_inputs.py"
TASKS = str(Path(__file__).with_name("join_tasks.py"))

COMMON = dict(timeout=60, seed=0)
RUNS = {
    # DDP: each epoch inside Join; two epochs so the post-Join resync is exercised too
    "join": dict(COMMON, strategy="ddp", max_epochs=2),
    "join_accum": dict(COMMON, strategy="ddp", grad_accum=2),
    # a strategy with no Joinable: the ranks agree on the smaller count
    "agree": dict(COMMON, strategy="manual_allreduce", max_epochs=2),
    "agree_forced_ddp": dict(COMMON, strategy="ddp", join_mode="agree"),
    # stop requests and log steps under Join: rank 0 (5 batches) has joined when they come
    "join_log": dict(COMMON, strategy="ddp", log_every_n_steps=2),
    "join_request_stop": dict(COMMON, strategy="ddp", max_epochs=2, stop_at=(1, 6, "request")),
    "join_preempt": dict(COMMON, strategy="ddp", max_epochs=2, stop_at=(1, 6, "signal")),
}
HAVE_FSDP = importlib.util.find_spec("distrun_fsdp") is not None
if HAVE_FSDP:  # FSDP has no Joinable: the ranks agree on the step count
    RUNS["fsdp"] = dict(COMMON, strategy="fsdp")
# last: both ranks raise, then the group is not reused
RUNS["throw"] = dict(COMMON, strategy="ddp", join_throw_on_early_termination=True)


@pytest.fixture(scope="module")
def join_runs(tmp_path_factory, cpu_backend):
    run_dir = str(tmp_path_factory.mktemp("join"))
    runs = [dict(opts, run_dir=run_dir) for opts in RUNS.values()]
    out = run_on_ranks(fit_uneven, 2, runs, timeout=200, init_process_group=True,
                       backend=cpu_backend)
    return [dict(zip(RUNS, per_rank, strict=True)) for per_rank in out]


@pytest.mark.parametrize("name", ["join", "join_accum", "agree", "agree_forced_ddp"])
def test_uneven_ranks_finish_with_equal_parameters(join_runs, name):
    a, b = join_runs[0][name], join_runs[1][name]
    assert "error" not in a and "error" not in b, (a, b)
    torch.testing.assert_close(a["params"], b["params"], rtol=0, atol=0)
    assert a["steps"] == b["steps"]  # the group's step count, the same on both ranks


def test_join_counts_the_longest_ranks_steps(join_runs):
    assert join_runs[0]["join"]["steps"] == 16  # 8 steps x 2 epochs: rank 0 shadowed 3 a epoch
    assert join_runs[0]["join_accum"]["steps"] == 4  # 8 micro-batches / 2


def test_log_every_n_steps_holds_under_join(join_runs):
    # 8 steps in the epoch: rows at 2, 4, 6, 8 on rank 0 too, though it ran out after step 5
    assert join_runs[0]["join_log"]["logged"] == [2, 4, 6, 8]
    assert join_runs[1]["join_log"]["logged"] == [2, 4, 6, 8]


def test_a_stop_request_under_join_ends_every_rank_after_the_same_step(join_runs):
    a, b = join_runs[0]["join_request_stop"], join_runs[1]["join_request_stop"]
    assert "error" not in a and "error" not in b, (a, b)
    # asked on rank 1 after step 6 of 8 (rank 0 had joined at 5): agreed at the next vote,
    # at the latest the one that ends the epoch; both ranks stop after the same step and the
    # second epoch never starts
    assert a["steps"] == b["steps"] and 7 <= a["steps"] <= 8, (a["steps"], b["steps"])
    torch.testing.assert_close(a["params"], b["params"], rtol=0, atol=0)


def test_a_preemption_under_join_exits_every_rank_for_requeue(join_runs):
    a, b = join_runs[0]["join_preempt"], join_runs[1]["join_preempt"]
    assert a.get("exit") == b.get("exit") == 143, (a, b)


def test_agree_drops_the_surplus_batches(join_runs):
    # every rank trains on min(5, 8) = 5 batches per epoch; rank 1's last 3 are dropped
    assert join_runs[0]["agree"]["micro_steps"] == join_runs[1]["agree"]["micro_steps"] == 10
    assert join_runs[0]["agree"]["strategy"] == "manual_allreduce"
    assert join_runs[1]["agree_forced_ddp"]["steps"] == 5


@pytest.mark.skipif(not HAVE_FSDP, reason="distrun-fsdp is not installed")
def test_fsdp_without_a_joinable_agrees_on_the_step_count(join_runs):
    a, b = join_runs[0]["fsdp"], join_runs[1]["fsdp"]
    assert "error" not in a and "error" not in b, (a, b)
    assert a["strategy"] == "fsdp"
    assert a["micro_steps"] == b["micro_steps"] == 5  # min(5, 8): rank 1's last 3 dropped
    torch.testing.assert_close(a["params"], b["params"], rtol=0, atol=0)


def test_throw_on_early_termination_raises_on_both_ranks(join_runs):
    first, second = join_runs[0]["throw"]["error"], join_runs[1]["throw"]["error"]
    assert first.startswith("rank 0: this rank ran out of batches in epoch 0 at step 5")
    assert second.startswith("rank 1: another rank ran out of batches in epoch 0")
    assert "join_throw_on_early_termination" in first


@pytest.mark.slow
def test_join_tutorial_example_completes(tmp_path):
    result = run_cli("run", "--nproc-per-node", "2", "--strategy", "ddp", "--run-dir",
                     str(tmp_path / "run"), str(EXAMPLE), cwd=tmp_path)
    assert result.returncode == 0, result
    lines = [ln for ln in result.stdout.splitlines() if "has exhausted all" in ln]
    assert len(lines) == 2, result
    assert any(ln.startswith("Rank 0 has exhausted all 5 of its inputs!") for ln in lines)
    assert any(ln.startswith("Rank 1 has exhausted all 6 of its inputs!") for ln in lines)
    weights = {ln.split("weight ")[1].split(",")[0] for ln in lines}
    assert len(weights) == 1, lines  # both ranks end with the same parameters


@pytest.mark.slow
def test_without_the_plugin_uneven_inputs_end_in_a_clear_timeout(tmp_path):
    result = run_cli("-p", "no:join", "run", "--nproc-per-node", "2", "--strategy", "ddp",
                     "--timeout", "20", "--stall-timeout", "3", "--run-dir", str(tmp_path / "run"),
                     f"{TASKS}:Uneven", cwd=tmp_path, timeout=240)
    assert result.returncode == 1, result
    # the stall watcher names the rank that ran out (3 s without a move) before the collective
    # times out (20 s)
    stall = [ln for ln in result.stderr.splitlines() if ln.startswith("error: stall")]
    assert len(stall) == 1, result.stderr
    assert re.search(r"rank \d \(host [^,]+, pid \d+\) at its epoch's end \(no batches left\) "
                     r"for \d+ s; it ran out of batches while the others still train \(uneven "
                     r"inputs: pip install distrun-join", stall[0]), stall
    assert "Traceback" not in result.stderr
