"""The tiny task of the elastic tests: a 2-layer regression net whose batches carry indices.

``EL_STEP_SLEEP=s`` sleeps s seconds per micro-step (so a test can signal a run mid-way).
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn

import distrun


class ElasticTask(distrun.Task):
    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(256, 8, generator=gen)
        y = x @ torch.randn(8, 1, generator=gen) + 0.05 * torch.randn(256, 1, generator=gen)
        self.data = torch.utils.data.TensorDataset(x, y, torch.arange(256))
        self.pause = float(os.environ.get("EL_STEP_SLEEP", "0"))

    def configure_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1), nn.Tanh(), nn.Linear(16, 1))

    def configure_optimizer(self, params):
        return torch.optim.AdamW(params, lr=0.01)

    def train_data(self):
        return self.data

    def training_step(self, model, batch):
        if self.pause:
            time.sleep(self.pause)
        x, y, _ = batch
        return nn.functional.mse_loss(model(x), y)
