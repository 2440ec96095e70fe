"""A task with two param groups (one named) and a OneCycle schedule that also cycles momentum."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import distrun

STEPS = 16  # 256 samples / global batch 32 x 2 epochs


def make_data(n: int, seed: int) -> torch.utils.data.TensorDataset:
    w = torch.randn(8, 1, generator=torch.Generator().manual_seed(1234))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen)
    return torch.utils.data.TensorDataset(x, x @ w + 0.01 * torch.randn(n, 1, generator=gen))


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    """Group "body" (the first layer's weight and bias) and an unnamed group (the head)."""
    params = list(params)
    return torch.optim.SGD([{"params": params[:2], "name": "body"},
                            {"params": params[2:], "lr": 0.01}], lr=0.05, momentum=0.9)


def make_schedule(optimizer: torch.optim.Optimizer) -> Any:
    """OneCycle over both groups; it cycles SGD's momentum too."""
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=[0.1, 0.02], total_steps=STEPS,
                                               cycle_momentum=True)


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


class TwoGroups(distrun.Task):
    def configure_model(self) -> nn.Module:
        return make_model()

    def configure_optimizer(self, params: Any) -> torch.optim.Optimizer:
        return make_optimizer(params)

    def configure_scheduler(self, optimizer: torch.optim.Optimizer) -> Any:
        return make_schedule(optimizer)

    def train_data(self) -> Any:
        return make_data(256, seed=0)

    def val_data(self) -> Any:
        return make_data(64, seed=1)

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(model(x), y)

    def validation_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(model(x), y)
