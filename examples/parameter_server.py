"""A parameter server on scikit-learn's digits: 1 server + 2 trainers, synchronous or not.

    distrun run --nproc-per-node 3 --strategy rpc examples/parameter_server.py
    distrun run --nproc-per-node 3 --strategy rpc --rpc-mode async examples/parameter_server.py
    distrun run --nproc-per-node 4 --strategy rpc --rpc-servers 2 examples/parameter_server.py

The parameters live on the server rank (the last one; sharded over the last S ranks with
``--rpc-servers S``). In sync mode each trainer step runs forward and backward through
distributed autograd and a DistributedOptimizer step on the server; in async mode trainers
push gradients and the server averages ``--rpc-update-batch`` of them per update. The model
is a small MLP on the 8x8 images (the data split is examples/digits.py's); it reaches about
95% validation accuracy in a few seconds.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import distrun

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def digits_8x8(val_fraction: float = 0.2) -> tuple[torch.utils.data.Dataset, ...]:
    """(train, val): flattened 8x8 images in [0, 1], the same fixed split as digits.py."""
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32) / 16.0
    y = torch.tensor(labels, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234))
    n_val = int(len(y) * val_fraction)
    val, train = order[:n_val], order[n_val:]
    ds = torch.utils.data.TensorDataset
    return ds(x[train], y[train]), ds(x[val], y[val])


class DigitsMLP(distrun.Task):
    def __init__(self, lr: float = 0.05) -> None:
        self.lr = lr
        self.train_set, self.val_set = digits_8x8()

    def configure_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def configure_optimizer(self, params):
        return torch.optim.SGD(params, lr=self.lr, momentum=0.9)

    def train_data(self):
        return self.train_set

    def val_data(self):
        return self.val_set

    def training_step(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    def validation_step(self, model, batch):
        x, y = batch
        logits = model(x)
        return {"loss": F.cross_entropy(logits, y),
                "acc": (logits.argmax(dim=1) == y).float().mean()}


if __name__ == "__main__":
    run = distrun.fit(DigitsMLP(), strategy="rpc", max_epochs=5, batch_size=32,
                      log_every_n_steps=20)
    if run.is_global_zero and "val_acc" in run.metrics:
        print(f"validation accuracy: {run.metrics['val_acc']:.4f}")
