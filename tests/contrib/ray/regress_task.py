"""The Ray tests' task: a 4-input linear regression on 96 fixed samples.

Test modules write this source, followed by their own plugin class and ``__main__`` block,
into a ``task.py`` that ``distrun run --launcher ray`` starts on every node.
"""

import json  # noqa: F401  (for the plugin classes the tests append)
import os  # noqa: F401
import sys  # noqa: F401
import time  # noqa: F401

import torch

import distrun


class Regress(distrun.Task):
    def configure_model(self):
        return torch.nn.Linear(4, 1)

    def configure_optimizer(self, params):
        return torch.optim.SGD(params, lr=0.05)

    def train_data(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(96, 4, generator=g)
        return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))

    def training_step(self, model, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)
