"""distrun-amp's GradScaler steps under manual optimization, each optimizer on its own.

``--precision 16-mixed`` needs CUDA, so this runs the plugin's own ScaledSteps with a CPU
GradScaler (fp32 model): scaling by a power of two and unscaling is exact, so the scaled run
must equal the unscaled one bit for bit, clipping included, only if every ``opt.step()``
unscaled its own gradients before clipping and stepping."""

from __future__ import annotations

import pytest
import torch

import distrun
from distrun import Trainer
from distrun_amp import plugin as amp_plugin
from distrun_amp.plugin import AMP, ScaledSteps
from distrun_amp.precision import MixedPrecision


class TwoRegressors(distrun.Task):
    automatic_optimization = False

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(96, 8, generator=g)
        self.data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))

    def configure_model(self):
        return distrun.Models(a=torch.nn.Linear(8, 4), b=torch.nn.Linear(4, 1))

    def configure_optimizers(self, model):
        return [torch.optim.Adam(model.a.parameters(), lr=0.01),
                torch.optim.SGD(model.b.parameters(), lr=0.05, momentum=0.9)]

    def train_data(self):
        return self.data

    def training_step(self, model, batch):
        x, y = batch
        opt_a, opt_b = self.optimizers()
        loss = torch.nn.functional.mse_loss(model.b(model.a(x)), y)
        opt_a.zero_grad()
        opt_b.zero_grad()
        self.manual_backward(loss)
        opt_a.step()
        opt_b.step()
        return loss


class CpuScaler:
    """What distrun-amp sets up for 16-mixed, with a CPU GradScaler."""

    def __init__(self) -> None:
        amp = MixedPrecision.__new__(MixedPrecision)
        amp.precision, amp.device_type, amp.dtype = "16-mixed", "cpu", torch.float16
        amp.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=2)
        self.amp = amp

    @distrun.hookimpl
    def distrun_setup_strategy(self, run):
        run.stash[AMP] = self.amp
        run.add_hooks(ScaledSteps(self.amp))


def _fit(tmp_path, name, *plugins):
    run = Trainer(run_dir=str(tmp_path / name), batch_size=16, max_steps=5, grad_clip=0.5,
                  seed=2, summary=False, plugins=plugins).fit(TwoRegressors())
    return run, {k: v.detach().clone() for k, v in run.unwrapped_model().state_dict().items()}


def test_each_manual_step_unscales_clips_and_steps_its_own_optimizer(distrun_pm, tmp_path):
    scaler = CpuScaler()
    scaled, got = _fit(tmp_path, "scaled", amp_plugin, scaler)
    _, want = _fit(tmp_path, "plain")
    assert set(got) == {"a.weight", "a.bias", "b.weight", "b.bias"}
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    # the scaler updated after each optimizer step: 10 updates, growing every 2nd
    assert scaler.amp.scaler.get_scale() == pytest.approx(2.0 ** 12 * 2 ** 5)
    assert scaled.state_dict()["amp_scaler"]["scale"] == 2.0 ** 17  # it rides in checkpoints
