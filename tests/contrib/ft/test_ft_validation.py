"""Validation under --ft: each group validates at every epoch's end, as the core's loop does."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from distrun.testing import run_cli

DIGITS = str(Path(__file__).resolve().parents[3] / "examples" / "digits.py")


@pytest.mark.slow
def test_the_digits_demo_validates_under_ft(tmp_path):
    # the README's demo prints run.metrics['val_acc'] after fit: a KeyError when ft skipped it
    result = run_cli("run", "--ft", "--replica-groups", "2", "--nproc-per-node", "1",
                     "--strategy", "ddp", "--ft-heartbeat", "1", "--max-epochs", "2",
                     "--run-dir", str(tmp_path / "run"), "--no-progress", DIGITS,
                     cwd=tmp_path, env={"OMP_NUM_THREADS": "1"}, timeout=300)
    assert result.returncode == 0, result
    accuracies = re.findall(r"validation accuracy: (\d\.\d+)", result.stdout)
    assert len(accuracies) == 2 and len(set(accuracies)) == 1, result  # same weights, same figure
    assert float(accuracies[0]) > 0.8
    for group in (0, 1):  # every epoch's validation logged in the group's own metrics.csv
        csv = (tmp_path / "run" / f"replica{group}" / "metrics.csv").read_text()
        header = csv.splitlines()[0].split(",")
        rows = [dict(zip(header, line.split(","))) for line in csv.splitlines()[1:]]
        assert len([r for r in rows if r.get("val_acc")]) == 2, csv
