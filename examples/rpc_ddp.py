"""RPC + DDP: an embedding table on a parameter server, a dense head trained with DDP.

    distrun run --nproc-per-node 3 --strategy rpc examples/rpc_ddp.py

As in PyTorch's "Combining Distributed DataParallel with Distributed RPC Framework" tutorial:
the task's ``configure_remote()`` module (an ``EmbeddingBag``) lives on the server rank (the
last one) and trainers reach it through a ``RemoteModule``; ``configure_model()`` is the dense
part, wrapped in DDP over the two trainer ranks only. One distributed autograd pass and one
DistributedOptimizer step update both. The data is synthetic and learnable: each sample is a
bag of token ids drawn from one of four classes' vocabularies, the label is that class.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import distrun

VOCAB, DIM, CLASSES, BAG = 400, 16, 4, 6


def token_bags(n: int, seed: int) -> torch.utils.data.TensorDataset:
    """``n`` bags of ``BAG`` token ids; class ``c`` owns the ids ``i`` with ``i % CLASSES == c``."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, CLASSES, (n,), generator=gen)
    picks = torch.randint(0, VOCAB // CLASSES, (n, BAG), generator=gen)
    return torch.utils.data.TensorDataset(picks * CLASSES + labels[:, None], labels)


class BagsTask(distrun.Task):
    def __init__(self) -> None:
        self.train_set, self.val_set = token_bags(2048, seed=1), token_bags(512, seed=2)

    def configure_remote(self) -> nn.Module:
        """The part that lives on the parameter server."""
        return nn.EmbeddingBag(VOCAB, DIM, mode="mean")

    def configure_model(self) -> nn.Module:
        """The dense part, replicated on every trainer with DDP."""
        return nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Linear(32, CLASSES))

    def configure_optimizer(self, params):
        return torch.optim.Adam(params, lr=0.02)

    def train_data(self):
        return self.train_set

    def val_data(self):
        return self.val_set

    def training_step(self, model, batch):
        ids, labels = batch
        return F.cross_entropy(model(ids), labels)  # model(ids) == model.dense(model.remote(ids))

    def validation_step(self, model, batch):
        ids, labels = batch
        logits = model(ids)
        return {"loss": F.cross_entropy(logits, labels),
                "acc": (logits.argmax(dim=1) == labels).float().mean()}


if __name__ == "__main__":
    run = distrun.fit(BagsTask(), strategy="rpc", max_epochs=2, batch_size=64,
                      log_every_n_steps=8)
    if run.is_global_zero and "val_acc" in run.metrics:
        print(f"validation accuracy: {run.metrics['val_acc']:.4f}")
