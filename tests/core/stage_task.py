"""A task with every stage and every way of logging, for the stage, logging and scheduler tests.

Its test set has 63 samples, so 2 ranks with batches of 8 need filler batches: the tests check
that the filler counts nothing. Switches from the environment:

- ``STAGE_PLATEAU=1``: a ReduceLROnPlateau on ``val_loss`` per epoch next to a per-step StepLR;
- ``STAGE_RANK_VALUE=1``: training logs ``rank_value`` = rank + 1 (mean over ranks: 1.5)
  and ``count`` with ``reduce="sum"`` (1 per step per rank).
"""

from __future__ import annotations

import os

import torch
from torch import nn

import distrun

N_TEST = 63


def make_data(n: int, seed: int) -> torch.utils.data.TensorDataset:
    w = torch.randn(8, 1, generator=torch.Generator().manual_seed(1234))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen)
    return torch.utils.data.TensorDataset(x, x @ w + 0.01 * torch.randn(n, 1, generator=gen))


class StageTask(distrun.Task):
    def configure_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def configure_optimizer(self, params):
        return torch.optim.SGD(params, lr=0.05)

    def configure_scheduler(self, optimizer):
        if not os.environ.get("STAGE_PLATEAU"):
            return None
        return [torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.9),
                {"scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0),
                 "monitor": "val_loss", "interval": "epoch"}]

    def train_data(self):
        return make_data(256, seed=0)

    def val_data(self):
        return make_data(40, seed=1)

    def test_data(self):
        return make_data(N_TEST, seed=2)

    def training_step(self, model, batch):
        x, y = batch
        loss = nn.functional.mse_loss(model(x), y)
        if os.environ.get("STAGE_RANK_VALUE"):
            self.log("rank_value", float(int(os.environ.get("RANK", "0")) + 1))
            self.log("count", 1.0, reduce="sum")
            self.log("epoch_value", 2.0, on_step=False, on_epoch=True)
        return {"loss": loss, "doubled": 2 * loss.detach()}

    def validation_step(self, model, batch):
        x, y = batch
        if os.environ.get("STAGE_PLATEAU"):
            return torch.tensor(1.0)  # never improves: the plateau scheduler cuts every epoch
        return nn.functional.mse_loss(model(x), y)

    def test_step(self, model, batch):
        x, y = batch
        out = model(x)
        self.log("mae", (out - y).abs().mean())
        return {"loss": nn.functional.mse_loss(out, y)}


def reference(model: nn.Module) -> dict[str, float]:
    """The test metrics over the whole test set in one batch (what any rank count must give)."""
    ds = make_data(N_TEST, seed=2)
    x, y = ds.tensors
    with torch.no_grad():
        out = model(x)
    return {"test_loss": nn.functional.mse_loss(out, y).item(),
            "test_mae": (out - y).abs().mean().item()}


if __name__ == "__main__":
    # `python stage_task.py` / `distrun run stage_task.py`: fit, then every other stage on
    # the trained model in the same processes; rank 0 saves what they gave
    task = StageTask()
    trainer = distrun.Trainer(max_epochs=2, batch_size=16, summary=False)
    run = trainer.fit(task)
    results = {"test": trainer.test(), "validate": trainer.validate(),
               "predict": trainer.predict(), "reference": reference(run.unwrapped_model()),
               "lr": run.optimizer.param_groups[0]["lr"]}
    if run.is_global_zero and os.environ.get("STAGE_OUT"):
        torch.save(results, os.environ["STAGE_OUT"])
