"""distrun-amp: bf16 autocast really runs on CPU and trains; 16-mixed needs CUDA."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from distrun.testing import imports_torch, run_cli, run_on_ranks
from distrun_amp.plugin import AMP

HERE = Path(__file__).resolve().parent


def _fit(rank: int, world: int, precision: str, run_dir: str) -> dict:
    sys.path.insert(0, str(HERE))
    from amp_task import AmpTask

    import distrun

    task = AmpTask()
    run = distrun.fit(task, precision=precision, max_epochs=3, batch_size=32,
                      log_every_n_steps=4, run_dir=run_dir, summary=False)
    return {"losses": task.losses, "inner": sorted(set(task.inner_dtypes)),
            "val": sorted(set(task.val_dtypes)), "metrics": dict(run.metrics),
            "state": sorted(run.state_dict())}


@pytest.fixture(scope="module")
def fits(tmp_path_factory):
    """One 1-process fit per precision (spawned, so each gets a fresh plugin manager)."""
    out = {}
    for precision in ("bf16-mixed", "32-true"):
        run_dir = str(tmp_path_factory.mktemp(precision))
        out[precision] = run_on_ranks(_fit, 1, precision, run_dir)[0]
    return out


def test_bf16_autocast_is_active_in_training_and_validation(fits):
    assert fits["bf16-mixed"]["inner"] == ["torch.bfloat16"]
    assert fits["bf16-mixed"]["val"] == ["torch.bfloat16"]
    # Without the flag nothing is cast: the same matmul stays float32.
    assert fits["32-true"]["inner"] == ["torch.float32"]
    assert fits["32-true"]["val"] == ["torch.float32"]


def test_bf16_training_decreases_the_loss(fits):
    losses = fits["bf16-mixed"]["losses"]
    assert len(losses) == 24  # 256 samples / 32 per step x 3 epochs
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < 0.5 * first, losses
    # bf16 follows the float32 run closely (same seed, same data order).
    ref = fits["32-true"]["losses"]
    assert abs(last - sum(ref[-4:]) / 4) < 0.1 * first
    assert fits["bf16-mixed"]["metrics"]["val_loss"] < 0.5 * first


def test_bf16_adds_no_checkpoint_state_without_a_scaler(fits):
    assert "amp_scaler" not in fits["bf16-mixed"]["state"]
    assert "progress" in fits["bf16-mixed"]["state"]


def test_cli_flag_and_choices(cli, tmp_path):
    task = f"{HERE / 'amp_task.py'}:AmpTask"
    bad = cli("run", "--precision", "bf16", task, cwd=tmp_path)  # in-process: nothing launches
    assert bad.returncode == 2, bad
    assert "bf16-mixed" in bad.stderr and "Allowed: 32-true, bf16-mixed, 16-mixed" in bad.stderr
    ok = run_cli("run", "--precision", "bf16-mixed", "--max-steps", "3", "--batch-size", "32",
                 "--no-summary", "--log-every-n-steps", "1", task, cwd=tmp_path)
    assert ok.returncode == 0, ok
    assert "precision = \"bf16-mixed\"  # flag" in next(
        (tmp_path / "runs").glob("*/config.toml")).read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error path")
@pytest.mark.slow
def test_16_mixed_on_cpu_is_a_usage_error(tmp_path):
    task = f"{HERE / 'amp_task.py'}:AmpTask"
    result = run_cli("run", "--precision", "16-mixed", "--max-steps", "2", task, cwd=tmp_path)
    assert result.returncode == 2, result
    assert "16-mixed needs a CUDA device" in result.stderr
    assert "Traceback" not in result.output


def _fit_fp16_cuda(rank: int, world: int, run_dir: str) -> dict:
    sys.path.insert(0, str(HERE))
    from amp_task import AmpTask

    import distrun

    task = AmpTask()
    run = distrun.fit(task, precision="16-mixed", device="cuda", max_epochs=2, batch_size=32,
                      run_dir=run_dir, summary=False)
    state = run.state_dict()
    scaler = run.stash[AMP].scaler
    fresh = torch.amp.GradScaler("cuda")
    run.stash[AMP].scaler = fresh
    run.load_state_dict(state)
    return {"losses": task.losses, "inner": sorted(set(task.inner_dtypes)),
            "scale": float(scaler.get_scale()), "restored": float(fresh.get_scale()),
            "has_state": "amp_scaler" in state}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="16-mixed uses a CUDA GradScaler; this machine has no CUDA device")
def test_16_mixed_with_grad_scaler_on_cuda(tmp_path):
    res = run_on_ranks(_fit_fp16_cuda, 1, str(tmp_path))[0]
    assert res["inner"] == ["torch.float16"]
    assert res["losses"][-1] < res["losses"][0]
    assert res["has_state"] and res["restored"] == res["scale"]


def test_plugin_module_does_not_import_torch():
    assert not imports_torch("distrun_amp.plugin")
