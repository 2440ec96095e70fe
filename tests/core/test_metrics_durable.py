"""metrics.csv on a full disk: one warning, training goes on, and no torn row is left.

The run folder is a 64 KiB tmpfs of its own (root only: the tests skip, saying so, elsewhere);
the task fills it at step 5, so the file's last page takes rows until one crosses into a page
there is no room for.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from distrun import testing
from distrun._loggers.csv_file import read_metrics
from distrun.testing import run_cli

HERE = Path(__file__).resolve().parent
FILL = str(HERE / "fill_task.py") + ":FillTask"
#: 200 rows of ~37 bytes: more than the metrics file's first 4 KiB page holds
FLAGS = ("run", "--log-every-n-steps", "1", "--batch-size", "2", "--max-steps", "200",
         "--no-summary")
WARNING = "warning: cannot write run/metrics.csv (No space left on device) at step "


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """``tmp_path/run``: a 64 KiB tmpfs, unmounted at the end."""
    with testing.small_disk(tmp_path / "run", "64k") as folder:
        yield folder


def _run(folder: Path, **env: str):
    return run_cli(*FLAGS, "--run-dir", "run", FILL, cwd=folder.parent, timeout=240,
                   env={"DISTRUN_DISABLE_PLUGIN_AUTOLOAD": "1", "FILL_DIR": str(folder),
                        "FILL_AT": "5", **env})


def _steps(folder: Path) -> list[int]:
    return [int(r["step"]) for r in read_metrics(str(folder / "metrics.csv"))]


@pytest.mark.slow
def test_a_full_disk_stops_the_rows_not_the_training_and_tears_none(small_disk):
    result = _run(small_disk)
    assert result.returncode == 0, result
    warnings = [ln for ln in result.output.splitlines() if "metrics.csv" in ln]
    assert len(warnings) == 1 and warnings[0].startswith(WARNING), result
    assert "Traceback" not in result.output, result
    text = (small_disk / "metrics.csv").read_bytes()
    assert text.endswith(b"\r\n"), text[-80:]  # the row cut short was taken back
    steps = _steps(small_disk)
    assert 5 < len(steps) < 200 and steps == list(range(1, len(steps) + 1)), steps
    for row in read_metrics(str(small_disk / "metrics.csv")):
        assert set(row) == {"step", "epoch", "time", "loss", "samples_per_sec", "lr"}, row
    assert sorted(p.name for p in small_disk.iterdir() if "metrics" in p.name) == \
        ["metrics.csv"]  # no temporary file left by the end's try


@pytest.mark.slow
def test_rows_kept_while_the_disk_was_full_are_written_once_there_is_room(small_disk):
    result = _run(small_disk, FREE_AT="190")
    assert result.returncode == 0, result
    assert sum("metrics.csv" in ln for ln in result.output.splitlines()) == 1, result
    assert _steps(small_disk) == list(range(1, 201)), result
