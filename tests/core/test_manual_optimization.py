"""Manual optimization and several optimizers in one process: the manual step equals the
automatic one bit for bit, the return forms of configure_optimizers, the one-line refusals,
and OptimizerGroup's state round trip (the 2-rank GAN runs are tests/integration/
test_gan_digits.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import distrun
from distrun import Trainer, UsageError

sys.path.insert(0, str(Path(__file__).parent))
from tiny_task import TinyTask  # noqa: E402


def weights(run) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in run.unwrapped_model().state_dict().items()}


def fit(tmp_path, task, **options):
    options.setdefault("summary", False)
    return Trainer(run_dir=str(tmp_path / "run"), batch_size=32, debug=True,
                   **options).fit(task)


class Scheduled(TinyTask):
    def configure_scheduler(self, optimizer):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


class ManualTiny(Scheduled):
    automatic_optimization = False

    def training_step(self, model, batch):
        x, y = batch
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.lr_schedulers().step()
        return loss


def test_a_manual_step_equals_the_automatic_one_bit_for_bit(distrun_pm, tmp_path):
    auto = fit(tmp_path, Scheduled(), max_steps=5, grad_clip=0.1)
    manual = fit(tmp_path, ManualTiny(), max_steps=5, grad_clip=0.1)  # clipped in opt.step()
    assert manual.progress.step == auto.progress.step == 5
    assert manual.metrics["loss"] == auto.metrics["loss"]
    assert manual.optimizer.param_groups[0]["lr"] == auto.optimizer.param_groups[0]["lr"] \
        == 0.05 * 0.5 ** 2
    for k, v in weights(auto).items():
        assert torch.equal(weights(manual)[k], v), k


class TwoModels(TinyTask):
    """Two regressors, each with its own optimizer and scheduler (Lightning's return forms)."""

    automatic_optimization = False
    form = "lists"

    def configure_model(self):
        return distrun.Models(a=torch.nn.Linear(8, 1), b=torch.nn.Linear(8, 1))

    def configure_optimizers(self):  # Lightning's signature: the task keeps no model here
        model = self.model_seen
        opt_a = torch.optim.SGD(model.a.parameters(), lr=0.05)
        opt_b = torch.optim.Adam(model.b.parameters(), lr=0.01)
        s_a = torch.optim.lr_scheduler.StepLR(opt_a, 1, gamma=0.9)
        s_b = torch.optim.lr_scheduler.StepLR(opt_b, 1, gamma=0.8)
        if self.form == "lists":
            return [opt_a, opt_b], [s_a, s_b]
        return [{"optimizer": opt_a, "lr_scheduler": s_a},
                {"optimizer": opt_b, "lr_scheduler": {"scheduler": s_b, "interval": "step"}}]

    def val_data(self):
        return None

    def training_step(self, model, batch):
        x, y = batch
        for opt, net in zip(self.optimizers(), (model.a, model.b)):
            loss = torch.nn.functional.mse_loss(net(x), y)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        for s in self.lr_schedulers():
            s.step()
        return None  # nothing to log as "loss"


@pytest.mark.parametrize("form", ["lists", "dicts"])
def test_two_optimizers_step_their_own_models_and_schedulers(distrun_pm, tmp_path, form):
    task = TwoModels()
    task.form = form

    class Keep:
        @staticmethod
        @distrun.hookimpl(tryfirst=True)
        def distrun_setup_optimizer(run):
            task.model_seen = run.model

    run = Trainer(run_dir=str(tmp_path / "run"), batch_size=32, max_steps=3, summary=False,
                  plugins=(Keep(),)).fit(task)
    opt_a, opt_b = task.optimizers()
    assert type(opt_a.optimizer) is torch.optim.SGD and type(opt_b.optimizer) is torch.optim.Adam
    assert int(opt_b.state[next(iter(opt_b.state))]["step"]) == 3
    assert [g["lr"] for g in run.optimizer.param_groups] == [
        pytest.approx(0.05 * 0.9 ** 3), pytest.approx(0.01 * 0.8 ** 3)]
    assert len(run.schedulers) == 2 and "loss" not in run.metrics
    assert set(weights(run)) == {"a.weight", "a.bias", "b.weight", "b.bias"}


def test_optimizer_group_state_round_trips_into_fresh_optimizers():
    from distrun._train.optimizers import OptimizerGroup

    def group(seed):
        torch.manual_seed(seed)
        a, b = torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)
        opts = [torch.optim.Adam(a.parameters(), lr=0.1),
                torch.optim.SGD(b.parameters(), lr=0.2, momentum=0.9)]
        return a, b, OptimizerGroup(opts)

    a, b, trained = group(0)
    for _ in range(2):
        (b(a(torch.randn(4, 3))) ** 2).sum().backward()
        trained.step()
    sd = trained.state_dict()
    assert len(sd["param_groups"]) == 2 and sorted(sd["state"]) == [0, 1, 2, 3]
    _, _, fresh = group(1)
    fresh.load_state_dict(sd)
    for mine, theirs in zip(fresh.optimizers, trained.optimizers):
        want, got = theirs.state_dict(), mine.state_dict()
        assert want["param_groups"] == got["param_groups"]
        for i, state in want["state"].items():
            assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(got["state"][i][k]))
                       for k, v in state.items())


class SeveralAutomatic(TwoModels):
    automatic_optimization = True

    def configure_optimizers(self, model):
        return [torch.optim.SGD(model.a.parameters(), lr=0.1),
                torch.optim.SGD(model.b.parameters(), lr=0.1)]


class AccumManual(ManualTiny):
    pass


def test_what_manual_optimization_refuses_in_one_line(distrun_pm, tmp_path):
    with pytest.raises(UsageError, match=r"returned 2 optimizers: several optimizers need "
                       r"manual optimization; set `automatic_optimization = False`"):
        fit(tmp_path, SeveralAutomatic(), max_steps=1)
    with pytest.raises(UsageError, match=r"^--grad-accum 2: AccumManual steps its optimizers "
                       r"itself \(automatic_optimization = False\)"):
        fit(tmp_path, AccumManual(), max_steps=1, grad_accum=2)
    with pytest.raises(UsageError, match=r"ManualTiny.optimizers\(\) is available once the "
                       r"trainer has set the task up"):
        ManualTiny().optimizers()
