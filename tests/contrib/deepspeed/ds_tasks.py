"""Tasks and rank functions for the distrun-deepspeed tests."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import distrun

_KEEP: list[Any] = []


class Blocks(distrun.Task):
    """Eight linear blocks on a fixed regression: ZeRO partitions them over the ranks.
    ``sgd``: SGD with momentum (an optimizer DeepSpeed has not tested) instead of AdamW."""

    def __init__(self, sgd: bool = False) -> None:
        self.sgd = sgd
        gen = torch.Generator().manual_seed(7)
        self.x = torch.randn(128, 32, generator=gen)
        self.y = torch.randn(128, 32, generator=gen)

    def configure_model(self) -> nn.Module:
        layers: list[nn.Module] = []
        for _ in range(8):
            layers += [nn.Linear(32, 32), nn.Tanh()]
        return nn.Sequential(*layers)

    def configure_optimizer(self, params: Any) -> torch.optim.Optimizer:
        if self.sgd:
            return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)

    def train_data(self) -> Any:
        return torch.utils.data.TensorDataset(self.x, self.y)

    def val_data(self) -> Any:
        return torch.utils.data.TensorDataset(self.x[:32], self.y[:32])

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(model(x), y)

    def validation_step(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"val_loss": F.mse_loss(model(x), y)}


def fit_all(rank: int, world: int, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fit ``Blocks`` once per options dict; whole weights and whole optimizer state of each."""
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    out = []
    for options in runs:
        options = dict(options)
        if "port" in options:  # each fit meets on a store of its own
            os.environ["MASTER_PORT"] = str(options.pop("port"))
        sgd = options.pop("sgd", False)
        run = distrun.Trainer(summary=False, **options).fit(Blocks(sgd))
        _KEEP.append(run)
        full = run.optimizer.state_dict()  # collective under DeepSpeed: every rank calls it
        weights = run.unwrapped_model().state_dict()  # gathered under ZeRO-3
        out.append({
            "weights": {k: v.detach().clone() for k, v in weights.items()},
            "optimizer": {i: {k: v.clone() if isinstance(v, torch.Tensor) else v
                              for k, v in entry.items()}
                          for i, entry in full["state"].items()},
            "lr": [g["lr"] for g in full["param_groups"]],
            "steps": run.progress.step,
            "engine": type(run.model).__name__,
        })
    return out
