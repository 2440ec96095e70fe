"""A small regression task with a test stage, which prints one line of its own mid-fit.

``PROGRESS_PRINT_AT=k``: rank 0's training_step prints ``task says hello at step k``
at its k-th call (a user's print while the bar is drawn).
"""

from __future__ import annotations

import os

import torch
from torch import nn

import distrun


def _data(n: int, seed: int) -> torch.utils.data.TensorDataset:
    w = torch.randn(8, 1, generator=torch.Generator().manual_seed(1234))
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))
    return torch.utils.data.TensorDataset(x, x @ w)


class FitTestTask(distrun.Task):
    def __init__(self) -> None:
        self.calls = 0

    def configure_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def configure_optimizer(self, params):
        return torch.optim.SGD(params, lr=0.05)

    def train_data(self):
        return _data(256, 0)

    def test_data(self):
        return _data(64, 2)

    def training_step(self, model, batch):
        self.calls += 1
        if str(self.calls) == os.environ.get("PROGRESS_PRINT_AT") \
                and os.environ.get("RANK", "0") == "0":
            print(f"task says hello at step {self.calls}", flush=True)
        x, y = batch
        return nn.functional.mse_loss(model(x), y)

    def test_step(self, model, batch):
        x, y = batch
        return {"loss": nn.functional.mse_loss(model(x), y)}
