"""distrun-early-stopping: real 2-rank runs that plateau, diverge, run unevenly and resume.

``es_tasks.Plateau`` freezes its learning rate at a known step, so ``val_loss`` is exactly
flat from there on and the step at which early stopping decides is known in advance.
``es_record`` (loaded with ``DISTRUN_PLUGINS``) has every rank write where its fit ended.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
from pathlib import Path

import pytest

from distrun.testing import imports_torch, run_cli
from distrun_early_stopping import EarlyStopping

HERE = Path(__file__).resolve().parent
PLATEAU = f"{HERE / 'es_tasks.py'}:Plateau"
UNEVEN = f"{HERE / 'es_tasks.py'}:UnevenPlateau"
RECORD = {"PYTHONPATH": str(HERE), "DISTRUN_PLUGINS": "es_record"}
COMMON = ("--nproc-per-node", "2", "--batch-size", "32", "--no-summary", "-p", "no:progress",
          "--early-stop-monitor", "val_loss")
pytestmark = pytest.mark.timeout(600)


def ends(run_dir: Path) -> list[dict]:
    """Where each rank's fit ended (written by es_record)."""
    return [json.loads((run_dir / f"end-rank{r}.json").read_text()) for r in (0, 1)]


def stop_lines(output: str) -> list[str]:
    return [ln for ln in output.splitlines() if ln.startswith("Early stopping at step")]


def val_loss_at(run_dir: Path, step: int) -> str:
    """The val_loss metrics.csv holds for ``step``, as the stop line prints it (6 digits)."""
    with open(run_dir / "metrics.csv", newline="") as fh:
        values = {float(r["val_loss"]) for r in csv.DictReader(fh)
                  if r["val_loss"] and int(r["step"]) == step}
    assert len(values) == 1, values
    return f"{values.pop():.6g}"


# -- the rule on its own (plain Python) ---------------------------------------------------------


def test_rule_counts_checks_without_improvement():
    rule = EarlyStopping("val_loss", patience=2, min_delta=0.1)
    assert rule.check(1.0, 2) is None and rule.best == 1.0
    assert rule.check(0.95, 4) is None and rule.wait == 1  # better, but not by more than 0.1
    assert rule.check(0.8, 6) is None and (rule.best, rule.best_step, rule.wait) == (0.8, 6, 0)
    assert rule.check(0.8, 6) is None and rule.wait == 0  # logged twice at one step: one check
    assert rule.check(0.75, 8) is None
    reason = rule.check(0.9, 10)
    assert reason == "val_loss did not improve by more than 0.1 in 2 checks"
    assert rule.stopped_at == 10 and rule.describe_best() == "best val_loss 0.8 at step 6"


def test_rule_max_mode_thresholds_and_non_finite():
    acc = EarlyStopping("val_acc", mode="max", patience=5, stopping_threshold=0.99,
                        divergence_threshold=0.1)
    assert acc.check(0.5, 1) is None
    assert acc.check(0.995, 2) == "val_acc = 0.995 reached the stopping threshold 0.99"
    assert acc.best == 0.995
    low = EarlyStopping("val_acc", mode="max", divergence_threshold=0.1)
    assert low.check(0.05, 1) == "val_acc = 0.05 is past the divergence threshold 0.1"
    nan = EarlyStopping("val_loss", patience=5)
    nan.check(1.0, 1)
    assert nan.check(math.nan, 2) == "val_loss is nan, not a finite number"
    assert nan.best == 1.0  # a NaN never becomes the best value
    lenient = EarlyStopping("val_loss", patience=2, check_finite=False)
    assert lenient.check(math.inf, 1) is None and lenient.best is None
    assert lenient.check(math.inf, 2) == "val_loss did not improve in 2 checks"
    with pytest.raises(ValueError, match="mode must be one of"):
        EarlyStopping("x", mode="avg")


def test_rule_state_round_trip_only_for_the_same_metric():
    rule = EarlyStopping("val_loss")
    for step, value in ((2, 1.0), (4, 1.0)):
        rule.check(value, step)
    state = json.loads(json.dumps(rule.state_dict()))  # what a checkpoint holds: JSON
    again = EarlyStopping("val_loss")
    assert again.load_state_dict(state) and (again.best, again.best_step, again.wait) == (1.0, 2, 1)
    other = EarlyStopping("val_acc", mode="max")
    assert not other.load_state_dict(state) and other.best is None


def test_plugin_module_does_not_import_torch():
    assert not imports_torch("distrun_early_stopping.plugin")


# -- real runs ----------------------------------------------------------------------------------


def test_ddp_stops_on_a_plateau_on_both_ranks(tmp_path):
    # lr 0 after step 6: val_loss improves at 2, 4, 6, then is flat at 8, 10, 12 (patience 3);
    # the epoch-end validation at step 8 repeats step 8's check and does not count twice
    result = run_cli("run", *COMMON, "--name", "es", "--strategy", "ddp", "--max-epochs", "5",
                     "--val-every-n-steps", "2", PLATEAU, cwd=tmp_path, env=RECORD)
    assert result.returncode == 0, result
    lines = stop_lines(result.stdout)
    assert len(lines) == 1, result  # rank 0 only, once
    best = val_loss_at(tmp_path / "runs" / "es", 6)
    assert lines == [f"Early stopping at step 12: val_loss did not improve in 3 checks (best "
                     f"val_loss {best} at step 6); stopping the fit"], result
    first, second = ends(tmp_path / "runs" / "es")
    assert first == second  # the same step, epoch and decision on both ranks
    assert first["stopped_at"] == 12
    assert 12 < first["step"] < 40  # 5 epochs x 8 steps without early stopping


def test_bad_mode_is_a_one_line_usage_error(cli, tmp_path):
    bad = cli("run", "--early-stop-monitor", "val_loss", "--early-stop-mode", "lowest", PLATEAU,
              cwd=tmp_path)
    assert bad.returncode == 2, bad
    assert bad.stderr.strip().splitlines() == [
        "error: invalid value for --early-stop-mode: 'lowest' Allowed: min, max"]


@pytest.mark.slow
def test_a_monitor_that_is_never_logged_is_named_with_the_metrics_that_are(tmp_path):
    result = run_cli("run", "--name", "miss", "--max-steps", "4", "--batch-size", "32",
                     "--val-every-n-steps", "2", "--log-every-n-steps", "2", "--no-summary",
                     "-p", "no:progress", "--early-stop-monitor", "val_acc", PLATEAU, cwd=tmp_path)
    assert result.returncode == 0, result
    warnings = [ln for ln in result.output.splitlines() if "--early-stop-monitor" in ln]
    assert len(warnings) == 1, result  # once, on rank 0
    head = ("warning: --early-stop-monitor val_acc: no metric of that name was logged by the "
            "validation at step 2 (logged: ")
    assert warnings[0].startswith(head) and warnings[0].endswith(
        "); early stopping waits for it"), warnings
    logged = warnings[0][len(head):].split(")")[0].split(", ")
    # the training row of step 2 and its validation (other plugins may add names)
    assert {"epoch", "loss", "samples_per_sec", "val_loss"} <= set(logged), logged


@pytest.mark.slow
def test_uneven_inputs_under_join_stop_without_a_hang(tmp_path):
    # rank 0 has 5 batches an epoch, rank 1 has 8: DDP runs each epoch under torch's Join and
    # validates at the end of each epoch (steps 8, 16, ...); lr 0 after step 6
    result = run_cli("run", *COMMON, "--name", "join", "--strategy", "ddp", "--join-mode", "join",
                     "--batch-size", "16", "--max-epochs", "10", "--early-stop-patience", "1",
                     "--timeout", "60", UNEVEN, cwd=tmp_path, env=RECORD)
    assert result.returncode == 0, result
    assert "join: epochs run inside torch's Join" in result.stdout
    assert stop_lines(result.stdout)[0].startswith(
        "Early stopping at step 16: val_loss did not improve in 1 check (best val_loss"), result
    first, second = ends(tmp_path / "runs" / "join")
    assert first == second and first["stopped_at"] == 16
    # asked at the epoch-end validation of step 16: the core agrees on it before another
    # epoch starts, so every rank ends at that step
    assert first["step"] == 16


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("distrun_fsdp") is None,
                    reason="distrun-fsdp is not installed")
def test_fsdp_stops_on_a_plateau(tmp_path):
    result = run_cli("run", *COMMON, "--name", "fsdp", "--strategy", "fsdp", "--max-epochs", "5",
                     "--val-every-n-steps", "2", PLATEAU, cwd=tmp_path, env=RECORD)
    assert result.returncode == 0, result
    assert "fsdp: dp 2 x tp 1 = 2 ranks" in result.stdout
    assert len(stop_lines(result.stdout)) == 1, result
    first, second = ends(tmp_path / "runs" / "fsdp")
    assert first == second and first["stopped_at"] == 12 and first["best_step"] == 6
    assert 12 < first["step"] < 40


@pytest.mark.slow
def test_a_non_finite_value_stops_at_once(tmp_path):
    # each rank validates 2 batches a pass: after 3 passes (steps 2, 4, 6) val_loss is NaN
    # (no sanity pass before training: its batches would count too)
    result = run_cli("run", *COMMON, "--name", "nan", "--strategy", "ddp", "--max-epochs", "5",
                     "--val-every-n-steps", "2", "--num-sanity-val-steps", "0", PLATEAU,
                     cwd=tmp_path,
                     env={**RECORD, "ES_NAN_AFTER": "6", "ES_FREEZE_AT": "100"})
    assert result.returncode == 0, result
    best = val_loss_at(tmp_path / "runs" / "nan", 6)
    assert stop_lines(result.stdout) == [
        f"Early stopping at step 8: val_loss is nan, not a finite number (best val_loss {best} "
        "at step 6); stopping the fit"], result
    first, second = ends(tmp_path / "runs" / "nan")
    assert first == second and first["stopped_at"] == 8 and first["step"] < 40


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("distrun_safetensors") is None,
                    reason="resuming needs a checkpoint plugin (distrun-safetensors)")
def test_a_resumed_run_goes_on_counting(tmp_path):
    env = {**RECORD, "ES_FREEZE_AT": "2"}  # flat from step 2 on
    common = (*COMMON, "--name", "res", "--strategy", "ddp", "--val-every-n-steps", "2")
    # checks at 2 (best), 4 and 6 (no improvement: wait 2 of 3); saved at the end, step 6
    first = run_cli("run", *common, "--max-steps", "6", "--ckpt-save-on-end", PLATEAU,
                    cwd=tmp_path, env=env)
    assert first.returncode == 0, first
    assert stop_lines(first.stdout) == [], first
    assert ends(tmp_path / "runs" / "res")[0]["wait"] == 2
    # resumed: the check at step 8 is the third without improvement. A fresh count would
    # take best at 8 and stop at 14.
    second = run_cli("run", *common, "--max-steps", "40", "--resume", "auto", PLATEAU,
                     cwd=tmp_path, env=env)
    assert second.returncode == 0, second
    assert "at step 6" in next(ln for ln in second.stdout.splitlines()
                               if ln.startswith("Resumed from")), second
    lines = stop_lines(second.stdout)
    assert len(lines) == 1 and lines[0].startswith(
        "Early stopping at step 8: val_loss did not improve in 3 checks (best val_loss"), second
    assert "at step 2)" in lines[0]  # the best value came from the first run
    first_end, second_end = ends(tmp_path / "runs" / "res")
    assert first_end == second_end and first_end["stopped_at"] == 8
    assert first_end["step"] < 14
