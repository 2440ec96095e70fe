"""A tiny regression task that records, per training step, the loss and the dtype a Linear
layer's output has inside the step (bfloat16 only when autocast is really active)."""

from __future__ import annotations

import torch
from torch import nn

import distrun


class AmpTask(distrun.Task):
    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(256, 16, generator=gen)
        w = torch.randn(16, 1, generator=gen)
        self.data = torch.utils.data.TensorDataset(x, torch.tanh(x @ w))
        self.losses: list[float] = []
        self.inner_dtypes: list[str] = []
        self.loss_dtypes: list[str] = []
        self.val_dtypes: list[str] = []

    def configure_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))

    def configure_optimizer(self, params):
        return torch.optim.SGD(params, lr=0.1)

    def train_data(self):
        return self.data

    def val_data(self):
        return torch.utils.data.TensorDataset(self.data.tensors[0][:64], self.data.tensors[1][:64])

    def training_step(self, model, batch):
        x, y = batch
        hidden = model[0](x)  # a matmul: its dtype shows whether autocast is on
        self.inner_dtypes.append(str(hidden.dtype))
        out = model[2](model[1](hidden))
        loss = nn.functional.mse_loss(out.float(), y)
        self.losses.append(float(loss))
        return loss

    def validation_step(self, model, batch):
        x, y = batch
        self.val_dtypes.append(str(model[0](x).dtype))
        return {"loss": nn.functional.mse_loss(model(x).float(), y)}
