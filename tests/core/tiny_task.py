"""A tiny regression task the core tests train; behaviour switches come from the environment.

- ``TINY_RAISE_AT=k``: training_step raises at micro-step k (exception path);
- ``TINY_SIGTERM_AT=k``: the process sends itself SIGTERM at micro-step k (preemption path);
- ``TINY_SAVE=path``: rank 0 saves the final weights there (torch.save of plain tensors).
"""

from __future__ import annotations

import os
import signal

import torch
from torch import nn

import distrun


def make_data(n: int = 256, seed: int = 0) -> torch.utils.data.TensorDataset:
    """Noisy samples of one fixed linear map (the same map for every seed)."""
    w = torch.randn(8, 1, generator=torch.Generator().manual_seed(1234))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen)
    y = x @ w + 0.01 * torch.randn(n, 1, generator=gen)
    return torch.utils.data.TensorDataset(x, y)


class TinyTask(distrun.Task):
    def __init__(self) -> None:
        self.data = make_data()
        self.val = make_data(64, seed=1)
        self.calls = 0

    def configure_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def configure_optimizer(self, params):
        return torch.optim.SGD(params, lr=0.05)

    def train_data(self):
        return self.data

    def val_data(self):
        return self.val

    def training_step(self, model, batch):
        self.calls += 1
        if os.environ.get("TINY_RAISE_AT") == str(self.calls):
            raise RuntimeError(f"boom at micro-step {self.calls}")
        if os.environ.get("TINY_SIGTERM_AT") == str(self.calls):
            os.kill(os.getpid(), signal.SIGTERM)
        x, y = batch
        return nn.functional.mse_loss(model(x), y)

    def validation_step(self, model, batch):
        x, y = batch
        return {"loss": nn.functional.mse_loss(model(x), y)}


def save_weights(run: distrun.Run) -> None:
    path = os.environ.get("TINY_SAVE")
    if path and run.is_global_zero:
        state = {k: v.detach().clone() for k, v in run.unwrapped_model().state_dict().items()}
        torch.save(state, path)


if __name__ == "__main__":
    finished = distrun.fit(TinyTask(), max_epochs=2, batch_size=32)
    save_weights(finished)
