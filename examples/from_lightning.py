"""A Lightning script ported to distrun: the digits classifier with the usual first-hour kit.

    python examples/from_lightning.py                               # one process
    distrun run --nproc-per-node 2 --strategy ddp examples/from_lightning.py

What the Lightning version had, and where it went (docs/coming-from-lightning.md has the
whole table):

- ``LightningModule``                  -> ``distrun.Task`` (the model is ``configure_model()``)
- ``self.log("train_acc", ...)``        -> the same ``self.log`` (reduced over ranks)
- ``configure_optimizers`` with ReduceLROnPlateau on ``val_loss`` -> ``configure_optimizer``
  returning the same dict
- ``EarlyStopping(monitor="val_loss", patience=3)`` -> ``early_stop_monitor="val_loss"``
  (distrun-early-stopping)
- ``ModelCheckpoint(monitor="val_acc", mode="max", save_top_k=2, save_last=True)`` ->
  ``ckpt_monitor="val_acc"``, ``ckpt_mode="max"``, ``ckpt_save_top_k=2``,
  ``ckpt_save_on_end=True`` (distrun-safetensors)
- ``LearningRateMonitor(logging_interval="step")`` -> ``lr_monitor=True`` (distrun-lr-monitor)
- ``trainer.fit(model, dm)`` then ``trainer.test(ckpt_path="best")`` -> the same calls

The digits ship with scikit-learn (nothing is downloaded). The run ends at about 97% test
accuracy, or earlier when validation stops improving.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import distrun

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from digits import Net, digits_split  # noqa: E402  (the MNIST CNN and the digits data)


class LitDigits(distrun.Task):
    def __init__(self, lr: float = 2e-3) -> None:
        self.lr = lr
        train, self.test_set = digits_split(val_fraction=0.2)
        # Lightning's datamodule split the training part once more for validation
        n_val = len(train) // 8
        self.train_set = torch.utils.data.Subset(train, range(n_val, len(train)))
        self.val_set = torch.utils.data.Subset(train, range(n_val))

    def configure_model(self) -> nn.Module:
        return Net()

    def configure_optimizer(self, params):
        optimizer = torch.optim.AdamW(params, lr=self.lr)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=1)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss",
                                 "interval": "epoch"}}

    def train_data(self):
        return self.train_set

    def val_data(self):
        return self.val_set

    def test_data(self):
        return self.test_set

    def training_step(self, model, batch):
        x, y = batch
        logits = model(x)
        self.log("train_acc", (logits.argmax(dim=1) == y).float().mean())
        return F.cross_entropy(logits, y)

    def validation_step(self, model, batch):
        x, y = batch
        logits = model(x)
        return {"loss": F.cross_entropy(logits, y),
                "acc": (logits.argmax(dim=1) == y).float().mean()}

    def test_step(self, model, batch):
        return self.validation_step(model, batch)


def main() -> dict[str, float]:
    trainer = distrun.Trainer(
        max_epochs=int(os.environ.get("EPOCHS", "8")), batch_size=64, log_every_n_steps=5,
        early_stop_monitor="val_loss", early_stop_patience=3, lr_monitor=True,
        ckpt_monitor="val_acc", ckpt_mode="max", ckpt_save_top_k=2, ckpt_save_on_end=True)
    task = LitDigits()
    run = trainer.fit(task)
    metrics = trainer.test(ckpt_path="best")
    if run.is_global_zero:
        print(f"best checkpoint: {run.resumed_from}")
        print(f"test accuracy: {metrics['test_acc']:.4f} (test loss {metrics['test_loss']:.4f})")
    trainer.close()
    return metrics


if __name__ == "__main__":
    main()
