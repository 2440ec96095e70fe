"""A tiny task with dropout and an LR schedule: resume must restore RNG, optimizer, schedule
and data cursor to end bit-identical."""

from __future__ import annotations

import torch
from torch import nn

import distrun


class Task(distrun.Task):
    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(7)
        x = torch.randn(64, 6, generator=gen)
        y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(64, 1, generator=gen)
        self.data = torch.utils.data.TensorDataset(x, y)

    def configure_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))

    def configure_optimizer(self, params):
        return torch.optim.AdamW(params, lr=0.01)

    def configure_scheduler(self, optimizer):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)

    def parallelize_plan(self, mesh):
        """For the tp strategy: the hidden layer column-wise, the output row-wise."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {"0": ColwiseParallel(), "3": RowwiseParallel()}

    def train_data(self):
        return self.data

    def training_step(self, model, batch):
        x, y = batch
        return nn.functional.mse_loss(model(x), y)

