"""Tasks whose finder answers are known in advance (tests/contrib/tune).

- :class:`Quadratic`: full-batch gradient descent on ``0.5 * sum_i h_i (w_i - 1)^2`` with
  curvatures ``h_i`` from ``L / 10`` to ``L`` (``QUAD_L``, default 10): plain SGD converges
  for lr < 2/L, fastest near 1/L, and diverges above 2/L. The data are 8 samples, one per
  coordinate, so ``--batch-size 8`` is the full batch on any number of data-parallel ranks.
- :class:`MemoryHog`: each training step holds ``MEM_MIB`` MiB per sample (``MEM_MIB`` times
  ``rank + 1`` with ``MEM_BY_RANK=1``) on top of a tiny model, so a rank's peak memory is its
  baseline plus that times the batch.
"""

from __future__ import annotations

import os

import torch
from torch import nn

import distrun

DIM = 8
MIB = 1024**2


def curvatures(big_l: float) -> torch.Tensor:
    return big_l * (0.1 + 0.9 * torch.arange(DIM, dtype=torch.float64) / (DIM - 1))


class Quadratic(distrun.Task):
    def __init__(self) -> None:
        h = curvatures(float(os.environ.get("QUAD_L", "10")))
        # sample i: x = sqrt(n h_i) e_i, y = x . 1; the mean over the n = DIM samples of
        # 0.5 (x.w - y)^2 is 0.5 sum_i h_i (w_i - 1)^2
        x = torch.diag((DIM * h).sqrt()).float()
        self.data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))

    def configure_model(self) -> nn.Module:
        model = nn.Linear(DIM, 1, bias=False)
        nn.init.zeros_(model.weight)
        return model

    def configure_optimizer(self, params):
        return torch.optim.SGD(params, lr=0.01)

    def train_data(self):
        return self.data

    def training_step(self, model, batch):
        x, y = batch
        return 0.5 * nn.functional.mse_loss(model(x), y)


class MemoryHog(distrun.Task):
    def __init__(self) -> None:
        scale = int(os.environ.get("RANK", "0")) + 1 if os.environ.get("MEM_BY_RANK") else 1
        self.per_sample = int(os.environ.get("MEM_MIB", "32")) * MIB * scale
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(512, DIM, generator=gen)
        self.data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))

    def configure_model(self) -> nn.Module:
        return nn.Linear(DIM, 1)

    def configure_optimizer(self, params):
        return torch.optim.SGD(params, lr=0.01)

    def train_data(self):
        return self.data

    def training_step(self, model, batch):
        x, y = batch
        # the activations of a large model, in one tensor: written, so every page is resident
        hog = torch.ones(len(x), self.per_sample // 4)
        return nn.functional.mse_loss(model(x), y) + 0.0 * hog[:, 0].mean()


class ManualQuadratic(Quadratic):
    """The quadratic with manual optimization (the finders refuse it)."""

    automatic_optimization = False

    def training_step(self, model, batch):
        opt = self.optimizers()
        opt.zero_grad()
        loss = super().training_step(model, batch)
        self.manual_backward(loss)
        opt.step()
        return loss
