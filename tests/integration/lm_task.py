"""A task that records what Lightning's LightningModule conveniences report, for
test_lightning_conveniences.py."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import distrun


def data(n: int, seed: int) -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    # the first feature is the sample's index: a step's batch says which samples it holds
    x = torch.cat([torch.arange(n, dtype=torch.float32)[:, None], torch.randn(n, 3, generator=gen)],
                  dim=1)
    return torch.utils.data.TensorDataset(x, torch.randn(n, 1, generator=gen))


class Recording(distrun.Task):
    """16 training samples (4 steps an epoch at --batch-size 4), 16 validation samples."""

    def __init__(self, lr: float = 0.05, hidden: int = 8, broken_val: bool = False) -> None:
        self.save_hyperparameters()
        self.steps: list[tuple[int, int, int, list[int]]] = []
        self.val_calls: list[int] = []  # global_step at each validation batch
        self.same_trainer = True
        self.deterministic: list[bool] = []

    def configure_model(self) -> nn.Module:
        h = self.hparams["hidden"]
        return nn.Sequential(nn.Linear(3, h), nn.Dropout(0.5), nn.Linear(h, 1))

    def configure_optimizer(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.hparams["lr"])

    def train_data(self) -> Any:
        return data(16, 0)

    def val_data(self) -> Any:
        return data(16, 1)

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        self.same_trainer &= self.trainer is not None and self.trainer.task is self
        self.steps.append((self.current_epoch, self.global_step, self.batch_idx,
                           x[:, 0].int().tolist()))
        self.deterministic.append(torch.are_deterministic_algorithms_enabled())
        return F.mse_loss(model(x[:, 1:]), y)  # (not the index)

    def validation_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        self.val_calls.append(self.global_step)
        if self.hparams["broken_val"]:
            raise ValueError("validation_step is broken")
        x, y = batch
        return F.mse_loss(model(x[:, 1:]), y)


class Shared(distrun.DataModule):
    """Data for several tasks: samples numbered from 100, so a step says where it came from."""

    def __init__(self) -> None:
        self.prepared = 0
        self.stages: list[str] = []

    def prepare_data(self) -> None:
        self.prepared += 1

    def setup(self, stage: str) -> None:
        self.stages.append(stage)

    def train_data(self) -> Any:
        d = data(8, 2)
        d.tensors[0][:, 0] += 100
        return d

    def val_data(self) -> Any:
        return data(4, 3)


class Block(nn.Module):
    """A block that counts its forwards (activation checkpointing runs it again in backward)."""

    calls = 0

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.lin, self.drop = nn.Linear(3, hidden), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Block.calls += 1
        return self.drop(torch.tanh(self.lin(x)))


class Blocky(Recording):
    def configure_model(self) -> nn.Module:
        return nn.Sequential(Block(self.hparams["hidden"]), nn.Linear(self.hparams["hidden"], 1))
