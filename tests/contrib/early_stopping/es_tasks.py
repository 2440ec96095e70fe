"""Tasks whose validation loss improves and then stays exactly flat, for early stopping.

The learning rate drops to 0 after ``ES_FREEZE_AT`` optimizer steps (a ``LambdaLR``), so the
weights, and with them ``val_loss``, stop changing: a real plateau at a known step.
``ES_NAN_AFTER=k`` makes every validation call after the k-th of this process return NaN.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import distrun


def make_data(n: int, seed: int) -> torch.utils.data.TensorDataset:
    w = torch.randn(8, 1, generator=torch.Generator().manual_seed(1234))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen)
    return torch.utils.data.TensorDataset(x, x @ w + 0.01 * torch.randn(n, 1, generator=gen))


class Plateau(distrun.Task):
    """256 training and 64 validation samples of a linear map; SGD, then a frozen lr."""

    def __init__(self) -> None:
        self.freeze_at = int(os.environ.get("ES_FREEZE_AT", "6"))
        self.nan_after = int(os.environ.get("ES_NAN_AFTER", "0"))
        self.val_calls = 0

    def configure_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def configure_optimizer(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.05)

    def configure_scheduler(self, optimizer: torch.optim.Optimizer) -> Any:
        freeze = self.freeze_at
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 if s < freeze else 0.0)

    def train_data(self) -> Any:
        return make_data(256, seed=0)

    def val_data(self) -> Any:
        return make_data(64, seed=1)

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(model(x), y)

    def validation_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        self.val_calls += 1
        x, y = batch
        loss = F.mse_loss(model(x), y)
        if self.nan_after and self.val_calls > self.nan_after:
            return loss * math.nan
        return loss


class Batches:
    """A plain iterable (no ``__getitem__``): each rank trains on its own, uneven, list."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


class UnevenPlateau(Plateau):
    """Rank 0 has 5 batches an epoch, rank 1 has 8 (so DDP runs each epoch under Join)."""

    def train_data(self) -> Any:
        rank = int(os.environ.get("RANK", "0"))
        data = make_data(64, seed=10 + rank)
        count = (5, 8)[rank % 2]
        return Batches([(data.tensors[0][i * 8:(i + 1) * 8], data.tensors[1][i * 8:(i + 1) * 8])
                        for i in range(count)])
