"""torchmetrics objects logged from steps, as in Lightning: computed over every rank at the end
of the pass or epoch, reset there, and untouched by the evaluation's filler batches."""

from __future__ import annotations

import os
import sys

import pytest

from distrun import Trainer
from distrun.testing import free_port, run_on_ranks

sys.path.insert(0, os.path.dirname(__file__))  # metric_task, importable by spawned ranks too
from metric_task import (  # noqa: E402
    N_EVAL,
    N_TRAIN,
    MetricTask,
    Rows,
    expected,
    fit_and_test,
    update_counts,
)

# two epochs of 8 steps, a log row at the end of each (so a row's step values are the epoch's)
COMMON = dict(max_epochs=2, batch_size=8, log_every_n_steps=8, summary=False, timeout=120.0)


def _check(rows: list[tuple[int, dict[str, float]]], test: dict[str, float],
           counts: dict[str, int]) -> None:
    """The logged values equal the one-process values over each whole set, exactly."""
    want = expected()
    val = [r for _, r in rows if "val_acc" in r]
    assert len(val) == 2, rows  # one per epoch (the sanity pass logs nothing)
    for row in val:
        # every sample counted once, and nothing left over from the sanity pass or the
        # previous epoch: the metrics were reset after each pass
        assert row["val_seen"] == N_EVAL, row
        assert row["val_acc"] == want["val_acc"] and row["val_f1"] == want["val_f1"], row
    train = [r for _, r in rows if "train_acc_epoch" in r]
    assert len(train) == 2, rows
    for row in train:
        assert row["train_seen"] == N_TRAIN and row["train_acc_epoch"] == want["train_acc"], row
    steps = [(s, r) for s, r in rows if "train_acc_step" in r]
    # each row's mean over its 8 steps' batches (equal sizes, all ranks) is the epoch's value
    assert [s for s, _ in steps] == [8, 16], rows
    assert all(r["train_acc_step"] == want["train_acc"] for _, r in steps), steps
    assert test == {"test_acc": want["test_acc"], "test_seen": float(N_EVAL)}, test
    assert set(counts.values()) == {0}, counts  # every logged metric ends reset


def test_logged_metric_objects_are_computed_and_reset_in_one_process(distrun_pm, tmp_path):
    rows, task = Rows(), MetricTask()
    with Trainer(plugins=(rows,), run_dir=str(tmp_path / "run"), **COMMON) as trainer:
        trainer.fit(task)
        test = trainer.test()
    _check(rows.rows, test, update_counts(task))


@pytest.mark.slow
def test_metric_objects_on_two_ranks_match_one_process_under_ddp_and_fsdp(tmp_path):
    # 65 evaluation samples on 2 ranks: rank 1 runs a filler batch, whose updates must not count
    runs = [dict(COMMON, strategy=name, plugins=f"distrun_{name}.plugin", port=free_port(),
                 run_dir=str(tmp_path / name)) for name in ("ddp", "fsdp")]
    per_rank = run_on_ranks(fit_and_test, 2, runs, timeout=300)
    for rank_out in per_rank:
        for out in rank_out:
            _check(out["rows"], out["test"], out["counts"])
