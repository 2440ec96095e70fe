"""A tiny task that fills the disk of its run folder at one micro-step and frees it at another.

- ``FILL_DIR``: the folder (on a small filesystem of its own) to fill;
- ``FILL_AT=k``: at micro-step k, a file ``filler`` there grows until the disk is full;
- ``FREE_AT=k``: at micro-step k, ``filler`` is removed.
"""

from __future__ import annotations

import os

import torch
from torch import nn

import distrun


class FillTask(distrun.Task):
    def __init__(self) -> None:
        x = torch.randn(512, 4, generator=torch.Generator().manual_seed(0))
        self.data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
        self.calls = 0

    def configure_model(self) -> nn.Module:
        return nn.Linear(4, 1)

    def configure_optimizer(self, params):
        return torch.optim.SGD(params, lr=0.01)

    def train_data(self):
        return self.data

    def training_step(self, model, batch):
        self.calls += 1
        filler = os.path.join(os.environ["FILL_DIR"], "filler")
        if os.environ.get("FILL_AT") == str(self.calls):
            with open(filler, "wb", buffering=0) as fh:
                try:
                    while True:
                        fh.write(b"x" * 512)
                except OSError:  # full: what the test wants
                    pass
        if os.environ.get("FREE_AT") == str(self.calls):
            os.unlink(filler)
        x, y = batch
        return nn.functional.mse_loss(model(x), y)
