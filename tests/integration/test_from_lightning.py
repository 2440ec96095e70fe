"""The ported Lightning example (docs/coming-from-lightning.md), run as a user would."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from distrun._loggers.csv_file import read_metrics
from distrun.testing import run_cli

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "from_lightning.py"


@pytest.mark.slow
def test_the_ported_lightning_example_trains_keeps_the_best_and_tests_it(tmp_path):
    for plugin in ("distrun_early_stopping", "distrun_lr_monitor", "distrun_safetensors"):
        pytest.importorskip(plugin, reason="the example uses the plugins of requirements-dev")
    result = run_cli("run", "--nproc-per-node", "2", "--strategy", "ddp", "--name", "lit",
                     str(EXAMPLE), cwd=tmp_path, env={"EPOCHS": "3"}, timeout=300)
    assert result.returncode == 0, result
    accuracy = float(re.search(r"test accuracy: ([0-9.]+)", result.stdout).group(1))
    assert accuracy > 0.85, result.stdout
    run_dir = tmp_path / "runs" / "lit"
    best = (run_dir / "checkpoints" / "best").read_text().strip()
    assert f"best checkpoint: runs/lit/checkpoints/{best}" in result.stdout
    rows = read_metrics(str(run_dir / "metrics.csv"))
    assert any("train_acc" in r and "lr-pg0" in r for r in rows)  # self.log, the LR monitor
    val = {int(r["step"]): r["val_acc"] for r in rows if "val_acc" in r}
    assert int(best.split("-")[1]) == max(val, key=lambda s: (val[s], -s))  # the best one
    tested = [r for r in rows if "test_acc" in r]
    assert len(tested) == 1 and tested[0]["test_acc"] == pytest.approx(accuracy, abs=1e-4)
