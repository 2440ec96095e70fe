"""distrun-tensorboard: event files written by a real run read back with TensorBoard's reader."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from distrun.testing import imports_torch, run_cli

TASK = Path(__file__).resolve().parents[2] / "core" / "tiny_task.py"


def accumulate(folder: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tb")
    result = run_cli("run", "--name", "tb", "--max-epochs", "2", "--batch-size", "32",
                     "--log-every-n-steps", "2", "--no-summary", str(TASK), cwd=tmp)
    assert result.returncode == 0, result
    return tmp / "runs" / "tb"


def test_scalars_read_back_with_tensorboard(finished_run):
    acc = accumulate(finished_run / "tensorboard")
    tags = set(acc.Tags()["scalars"])
    assert {"loss", "lr", "samples_per_sec", "epoch", "val_loss"} <= tags
    loss = acc.Scalars("loss")
    # 256 samples / 32 = 8 steps per epoch, 2 epochs, a log every 2 steps.
    assert [e.step for e in loss] == [2, 4, 6, 8, 10, 12, 14, 16]
    assert all(e.value == pytest.approx(0.05) for e in acc.Scalars("lr"))
    assert [e.step for e in acc.Scalars("val_loss")] == [8, 16]
    # The same numbers as the run's metrics.csv (both come from distrun_log_metrics).
    with open(finished_run / "metrics.csv") as fh:
        rows = [r for r in csv.DictReader(fh) if r["loss"]]
    assert [float(r["loss"]) for r in rows] == pytest.approx([e.value for e in loss], rel=1e-5)


def test_config_is_stored_as_text(finished_run):
    acc = accumulate(finished_run / "tensorboard")
    assert "config/text_summary" in acc.Tags()["tensors"]
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert 'max_epochs = 2  # flag' in text


@pytest.mark.slow
def test_off_and_custom_dir(tmp_path):
    result = run_cli("run", "--name", "off", "--max-steps", "2", "--no-tensorboard",
                     "--no-summary", str(TASK), cwd=tmp_path)
    assert result.returncode == 0, result
    assert not (tmp_path / "runs" / "off" / "tensorboard").exists()
    result = run_cli("run", "--name", "dir", "--max-steps", "4", "--log-every-n-steps", "2",
                     "--tensorboard-dir", str(tmp_path / "tbdir"), "--no-summary", str(TASK),
                     cwd=tmp_path)
    assert result.returncode == 0, result
    assert [e.step for e in accumulate(tmp_path / "tbdir").Scalars("loss")] == [2, 4]


def test_plugin_module_does_not_import_torch():
    assert not imports_torch("distrun_tensorboard.plugin")


@pytest.mark.slow
def test_resume_purges_the_replayed_steps(tmp_path):
    pytest.importorskip("distrun_safetensors", reason="resuming needs a checkpoint plugin")
    common = ("run", "--name", "r", "--batch-size", "32", "--log-every-n-steps", "2",
              "--no-summary")
    first = run_cli(*common, "--max-steps", "8", "--ckpt-every-n-steps", "3", str(TASK),
                    cwd=tmp_path)
    assert first.returncode == 0, first
    second = run_cli(*common, "--max-steps", "12", "--resume", "auto", str(TASK), cwd=tmp_path)
    assert second.returncode == 0, second
    acc = accumulate(tmp_path / "runs" / "r" / "tensorboard")
    # Resumed at step 6: the first run's step 8 is purged, the second run's step 8 stays.
    assert [e.step for e in acc.Scalars("loss")] == [2, 4, 6, 8, 10, 12]
    assert [e.step for e in acc.Scalars("val_loss")] == [8, 12]
