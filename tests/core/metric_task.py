"""A classifier that logs torchmetrics objects as a LightningModule does, for
test_metric_objects.py.

Its validation and test sets have 65 samples: on 2 ranks with batches of 4 per rank (global
8), rank 0 holds 33 samples (9 batches) and rank 1 32 (8 batches and a filler batch, its
first batch again). Its weights never change (SGD with lr 0), so each logged value has one
answer, computed in one process over the whole set by :func:`expected`. ``seen`` metrics sum
a 1 per sample: the number of samples a metric counted since its last reset.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.aggregation import SumMetric
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

import distrun

CLASSES = 3
N_TRAIN = 64  # 8 global batches of 8: every sample trains each epoch
N_EVAL = 65  # not a multiple of 2 ranks x 4: a filler batch on rank 1


def make_data(n: int, seed: int) -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=gen)
    return torch.utils.data.TensorDataset(x, torch.randint(0, CLASSES, (n,), generator=gen))


def make_model() -> nn.Module:
    model = nn.Linear(4, CLASSES)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        model.weight.copy_(torch.randn(CLASSES, 4, generator=gen))
        model.bias.copy_(torch.randn(CLASSES, generator=gen))
    return model


def _accuracy() -> MulticlassAccuracy:
    return MulticlassAccuracy(num_classes=CLASSES, average="micro")


def _f1() -> MulticlassF1Score:
    return MulticlassF1Score(num_classes=CLASSES, average="macro")


class MetricTask(distrun.Task):
    def __init__(self) -> None:
        self.train_acc = _accuracy()
        self.train_seen = SumMetric()
        self.val_acc = _accuracy()
        self.val_f1 = _f1()
        self.val_seen = SumMetric()
        self.test_acc = _accuracy()
        self.test_seen = SumMetric()

    def configure_model(self) -> nn.Module:
        return make_model()

    def configure_optimizer(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.0)  # fixed weights: one answer per metric

    def train_data(self) -> Any:
        return make_data(N_TRAIN, seed=0)

    def val_data(self) -> Any:
        return make_data(N_EVAL, seed=1)

    def test_data(self) -> Any:
        return make_data(N_EVAL, seed=2)

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        logits = model(x)
        self.train_acc(logits, y)  # the batch's accuracy, and accumulated for the epoch
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        self.train_seen.update(torch.ones(len(y)))
        self.log("train_seen", self.train_seen, on_step=False, on_epoch=True)
        return F.cross_entropy(logits, y)

    def validation_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        logits = model(x)
        self.val_acc.update(logits, y)  # update() alone
        self.val_f1(logits, y)  # forward
        self.val_seen.update(torch.ones(len(y)))
        self.log("val_acc", self.val_acc)
        self.log("val_f1", self.val_f1)
        self.log("val_seen", self.val_seen)
        return F.cross_entropy(logits, y)

    def test_step(self, model: nn.Module, batch: Any) -> None:
        x, y = batch
        self.test_acc.update(model(x), y)
        self.test_seen.update(torch.ones(len(y)))
        self.log("test_acc", self.test_acc)
        self.log("test_seen", self.test_seen)


def expected() -> dict[str, float]:
    """Every value the task logs, computed in this process over each whole set at once."""
    model = make_model()
    out: dict[str, float] = {}
    with torch.no_grad():
        for split, data in (("train", make_data(N_TRAIN, 0)), ("val", make_data(N_EVAL, 1)),
                            ("test", make_data(N_EVAL, 2))):
            x, y = data.tensors
            logits = model(x)
            out[f"{split}_acc"] = float(_accuracy()(logits, y))
            out[f"{split}_f1"] = float(_f1()(logits, y))
            out[f"{split}_seen"] = float(len(y))
    return out


class Rows:
    """A plugin keeping every logged row (exact floats, not the CSV's text)."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []

    @distrun.hookimpl
    def distrun_log_metrics(self, run: Any, step: int, metrics: Any) -> None:
        self.rows.append((step, {k: float(v) for k, v in metrics.items()}))


def update_counts(task: MetricTask) -> dict[str, int]:
    """How many updates each metric of the task holds now (0: reset)."""
    return {name: m.update_count for name, m in vars(task).items() if hasattr(m, "update_count")}


def fit_and_test(rank: int, world: int, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per options dict, a fit (2 epochs, validated after each) then the test stage, each in
    its own session; the rows this rank logged, the test result and the update counts left."""
    import os

    from distrun.testing import only_plugins

    out = []
    for options in runs:
        options = dict(options)
        os.environ.pop("DISTRUN_CONFIG", None)
        # a fresh store port per fit: a fast rank must not join the previous fit's store
        os.environ["MASTER_PORT"] = str(options.pop("port"))
        only_plugins(options.pop("plugins"))
        rows, task = Rows(), MetricTask()
        with distrun.Trainer(plugins=(rows,), **options) as trainer:
            trainer.fit(task)
            test = trainer.test()
        out.append({"rows": rows.rows, "test": test, "counts": update_counts(task)})
    return out
