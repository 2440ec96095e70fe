"""Validation under --ft: each group validates at every epoch's end and every
--val-every-n-steps steps, as the core's loop does."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from distrun.testing import run_cli

#: validate every 7 steps: not a divisor of an epoch's steps, so both cadences show
EVERY = 7
DIGITS = str(Path(__file__).resolve().parents[3] / "examples" / "digits.py")


@pytest.mark.slow
def test_the_digits_demo_validates_under_ft(tmp_path):
    # the README's demo prints run.metrics['val_acc'] after fit: a KeyError when ft skipped it
    result = run_cli("run", "--ft", "--replica-groups", "2", "--nproc-per-node", "1",
                     "--strategy", "ddp", "--ft-heartbeat", "1", "--max-epochs", "2",
                     "--val-every-n-steps", str(EVERY),
                     "--run-dir", str(tmp_path / "run"), "--no-progress", DIGITS,
                     cwd=tmp_path, env={"OMP_NUM_THREADS": "1"}, timeout=300)
    assert result.returncode == 0, result
    accuracies = re.findall(r"validation accuracy: (\d\.\d+)", result.stdout)
    assert len(accuracies) == 2 and len(set(accuracies)) == 1, result  # same weights, same figure
    assert float(accuracies[0]) > 0.8
    for group in (0, 1):  # every validation logged in the group's own metrics.csv
        csv = (tmp_path / "run" / f"replica{group}" / "metrics.csv").read_text()
        header = csv.splitlines()[0].split(",")
        rows = [dict(zip(header, line.split(","))) for line in csv.splitlines()[1:]]
        total = max(int(r["step"]) for r in rows)  # 2 epochs
        due = set(range(EVERY, total + 1, EVERY)) | {total // 2, total}  # each once
        assert total // 2 % EVERY and sorted(int(r["step"]) for r in rows if r.get("val_acc")) \
            == sorted(due), csv


AFTER_FIT = """
import distrun
from ft_task import Task

run = distrun.fit(Task())
raise RuntimeError(f"the report after fit failed at step {run.progress.step}")
"""


@pytest.mark.slow
def test_a_script_error_after_fit_is_not_taken_for_a_lost_group(ft, tmp_path):
    # each group trains to the end, then its script raises: that exit code, said once per
    # group, and no restart (a restarted group would only fail the same way, or wait forever
    # for a peer to heal from)
    (tmp_path / "after.py").write_text(AFTER_FIT)
    (tmp_path / "record").mkdir()
    result = run_cli("run", "--ft", "--replica-groups", "2", "--nproc-per-node", "1",
                     "--strategy", "ddp", "--batch-size", "16", "--max-steps", "3",
                     "--ft-heartbeat", "1", "--no-progress", "after.py", cwd=tmp_path,
                     env=ft.env(tmp_path / "record"), timeout=300)
    assert result.returncode == 1, result
    output = result.stdout + result.stderr
    assert output.count("RuntimeError: the report after fit failed at step 3") == 2, result
    for group in (0, 1):
        assert re.search(rf"replica group {group} finished training, then rank 0 exited with "
                         r"code 1: an error of the script after fit", output), result
    assert "restarting it" not in output, result
    # no --run-dir: the launcher named the run folder, so each group logged in its own
    (run,) = (tmp_path / "runs").iterdir()
    for group in (0, 1):
        rows = (run / f"replica{group}" / "metrics.csv").read_text().splitlines()
        assert rows[-1].split(",")[0] == "3", rows  # its last logged step
