"""The dp strategy: DataParallel on GPUs; on CPU a warned pass-through equal to single."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import distrun


class Tiny(distrun.Task):
    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(5)
        self.x = torch.randn(64, 8, generator=gen)
        self.y = torch.randn(64, 1, generator=gen)

    def configure_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def configure_optimizer(self, params):
        return torch.optim.SGD(params, lr=0.1)

    def train_data(self):
        return torch.utils.data.TensorDataset(self.x, self.y)

    def training_step(self, model, batch):
        x, y = batch
        return F.mse_loss(model(x), y)


def _fit(tmp_path, strategy: str) -> distrun.Run:
    return distrun.Trainer(strategy=strategy, batch_size=16, max_steps=4, seed=0,
                           run_dir=str(tmp_path / strategy), summary=False).fit(Tiny())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback needs a machine without CUDA")
def test_cpu_warns_once_and_trains_exactly_as_single(tmp_path):
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("distrun")
    logger.addHandler(handler)
    try:
        dp = _fit(tmp_path, "dp")
    finally:
        logger.removeHandler(handler)
    warnings = [r.getMessage() for r in records if "DataParallel does nothing" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in records]
    assert "training as 'single'" in warnings[0]
    single = _fit(tmp_path, "single")
    assert dp.strategy.name == "dp" and dp.progress.step == 4
    keys = list(dp.unwrapped_model().state_dict())
    assert keys and not any(k.startswith("module.") for k in keys)
    for (name, a), b in zip(dp.unwrapped_model().state_dict().items(),
                            single.unwrapped_model().state_dict().values(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_wraps_in_dataparallel_with_plain_keys(tmp_path):
    run = _fit(tmp_path, "dp")
    assert isinstance(run.model, nn.DataParallel)
    keys = list(run.unwrapped_model().state_dict())
    assert not any(k.startswith("module.") for k in keys)


def test_dp_with_several_processes_is_a_usage_error(cli, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('should not run')\n")
    result = cli("run", "--nproc-per-node", "2", "--strategy", "dp", str(script), cwd=tmp_path)
    assert result.returncode == 2, result
    assert "strategy 'dp' runs in one process" in result.stderr
    assert "should not run" not in result.stdout


def test_strategy_is_listed_with_its_plugin(cli):
    result = cli("strategies")
    assert result.returncode == 0, result
    line = next(ln for ln in result.stdout.splitlines() if ln.startswith("dp "))
    assert "DataParallel" in line and "[dp]" in line
