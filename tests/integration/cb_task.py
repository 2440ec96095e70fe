"""A task whose validation loss is a script (one known value per epoch), and a stateful
Lightning-style callback, for the callback-object tests."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import distrun

#: val_loss at the end of epochs 0, 1, 2 ... (exact in float32)
SCRIPT = (5.0, 3.0, 4.0, 1.0, 2.0, 6.0)


class Scripted(distrun.Task):
    """8 samples (2 steps an epoch at --batch-size 4); val_loss = SCRIPT[epoch]."""

    def configure_model(self) -> nn.Module:
        return nn.Linear(4, 1)

    def configure_optimizer(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.01)

    def train_data(self) -> Any:
        gen = torch.Generator().manual_seed(0)
        return torch.utils.data.TensorDataset(torch.randn(8, 4, generator=gen),
                                              torch.randn(8, 1, generator=gen))

    def val_data(self) -> Any:
        return self.train_data()

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(model(x), y)

    def validation_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return torch.tensor(SCRIPT[self.current_epoch])


class Counter:
    """A plain object with Lightning's method names (no distrun base class) that keeps state."""

    def __init__(self) -> None:
        self.batches = self.epochs = 0
        self.loaded: dict[str, int] | None = None
        self.seen: list[tuple[int, int, int]] = []  # (epoch, global step, batch_idx)
        self.val_ends: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches += 1
        self.seen.append((trainer.current_epoch, trainer.global_step, batch_idx))

    def on_validation_epoch_end(self, trainer, pl_module):
        self.val_ends.append(trainer.callback_metrics["val_loss"])

    def on_train_epoch_end(self, trainer, pl_module):
        self.epochs += 1

    def state_dict(self):
        return {"batches": self.batches, "epochs": self.epochs}

    def load_state_dict(self, state):
        self.loaded = dict(state)
        self.batches, self.epochs = state["batches"], state["epochs"]
