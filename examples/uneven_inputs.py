"""PyTorch's Join tutorial, as a distrun task: rank 0 has 5 inputs, rank 1 has 6.

    distrun run --nproc-per-node 2 --strategy ddp examples/uneven_inputs.py

This reproduces "Distributed Training with Uneven Inputs Using the Join Context Manager"
(pytorch.org/tutorials/advanced/generic_join.html): a DDP-wrapped ``nn.Linear(1, 1)``, the
loss ``model(input).sum()``, and one more input on each higher rank. Without distrun-join the
ranks fall out of step after rank 0's fifth input and the run stops with a timeout error; with
it, each epoch runs inside ``torch.distributed.algorithms.Join``: rank 0 shadows rank 1's last
all-reduce and both finish with the same parameters.
"""

from __future__ import annotations

import os

import torch
from torch import nn

import distrun

NUM_INPUTS = 5


class Inputs:
    """This rank's inputs: a plain iterable, so distrun uses it as-is on each rank."""

    def __init__(self, count: int) -> None:
        self.batches = [torch.tensor([1.0]) for _ in range(count)]

    def __iter__(self):
        return iter(self.batches)


class UnevenInputs(distrun.Task):
    def __init__(self) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.count = NUM_INPUTS + self.rank

    def configure_model(self) -> nn.Module:
        return nn.Linear(1, 1)

    def configure_optimizer(self, params):
        return torch.optim.SGD(params, lr=0.01)

    def train_data(self) -> Inputs:
        return Inputs(self.count)

    def training_step(self, model, batch):
        return model(batch).sum()


def main() -> None:
    task = UnevenInputs()
    run = distrun.fit(task, max_epochs=1, summary=False)
    weight = run.unwrapped_model().weight.item()
    print(f"Rank {run.rank} has exhausted all {task.count} of its inputs! "
          f"(weight {weight:.6f}, {run.progress.step} steps in the group)", flush=True)


if __name__ == "__main__":
    main()
