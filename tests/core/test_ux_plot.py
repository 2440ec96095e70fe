"""`distrun plot RUN_DIR -o loss.png` renders a real run's metrics into a non-trivial PNG."""

from __future__ import annotations

import pytest

from distrun.testing import run_cli

pytest.importorskip("matplotlib", reason="distrun plot needs matplotlib")


@pytest.mark.slow
def test_plot_of_a_real_run(tmp_path, tiny_script):
    result = run_cli("-p", "no:progress", "run", "--name", "p", "--max-epochs", "2",
                     "--batch-size", "32", "--log-every-n-steps", "2", "--no-summary",
                     tiny_script, cwd=tmp_path)
    assert result.returncode == 0, result
    result = run_cli("plot", "runs/p", "-o", "loss.png", cwd=tmp_path)
    assert result.returncode == 0, result
    assert result.stdout.strip() == "wrote loss.png (loss, val_loss, lr, samples_per_sec)"
    data = (tmp_path / "loss.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000

    import matplotlib.image
    import numpy as np

    pixels = matplotlib.image.imread(str(tmp_path / "loss.png"))
    assert pixels.shape[0] >= 600 and pixels.shape[1] >= 600  # three stacked panels
    colors = np.unique(pixels.reshape(-1, pixels.shape[-1]).round(2), axis=0)
    assert len(colors) > 50  # curves, text and grid, not a blank canvas
    # The default output lands in the run folder.
    assert run_cli("plot", "runs/p", cwd=tmp_path).returncode == 0
    assert (tmp_path / "runs" / "p" / "metrics.png").stat().st_size > 20_000


def test_plot_without_metrics_is_a_usage_error(cli, tmp_path):
    (tmp_path / "empty").mkdir()
    result = cli("plot", "empty", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("error: no metrics file at empty/metrics.csv")
