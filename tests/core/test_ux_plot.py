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


METRICS = "step,epoch,time,loss\n1,0.0,0.1,0.9\n2,0.0,0.2,0.8\n"
FIX = "restore the file, or delete or correct that line"


@pytest.mark.parametrize("content,line", [
    (METRICS.encode() + b"3,0.0,0.3,\xff\xfe\x00garbage\n",
     f"error: runs/p/metrics.csv line 4 is not text (byte 0xff): not a metrics.csv, or "
     f"damaged; {FIX}"),
    ((METRICS + "3,0.0,0.3,abc\n").encode(),
     f"error: runs/p/metrics.csv line 4, column 'loss': 'abc' is not a number; {FIX}"),
    ((METRICS + "3,0.0,0.3,0.7,0.1\n").encode(),
     f"error: runs/p/metrics.csv line 4 has more cells than its header has columns; {FIX}"),
    (bytes(range(256)) * 4,  # byte 10, a newline, comes before the first non-text byte
     f"error: runs/p/metrics.csv line 2 is not text (byte 0x80): not a metrics.csv, or "
     f"damaged; {FIX}"),
], ids=["binary-bytes", "a-word-in-a-cell", "a-row-too-wide", "no-csv-at-all"])
def test_plot_of_a_damaged_metrics_csv_names_the_file_and_line(tmp_path, content, line):
    run = tmp_path / "runs" / "p"
    run.mkdir(parents=True)
    (run / "metrics.csv").write_bytes(content)
    result = run_cli("plot", "runs/p", "-o", "loss.png", cwd=tmp_path, timeout=120)
    assert (result.returncode, result.stderr.splitlines()) == (2, [line]), result
    assert result.stdout == "" and not (tmp_path / "loss.png").exists()


def test_plot_reads_a_hand_edited_file_with_a_byte_order_mark(cli, tmp_path):
    (tmp_path / "m.csv").write_bytes(b"\xef\xbb\xbf" + METRICS.encode())
    result = cli("plot", "m.csv", "-o", "m.png", cwd=tmp_path)
    assert (result.returncode, result.stdout) == (0, "wrote m.png (loss)\n"), result
