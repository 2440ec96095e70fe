"""A task and a recording plugin for the process-lifecycle tests (workers import both).

Environment (set by the test): ``LC_REC`` a folder for records; ``LC_UNEVEN=1`` per-rank
iterables of different lengths (rank r has 12 + 4r batches: Join's case); ``LC_SLEEP``
seconds per step; ``LC_STOP_AT=step@rank`` that rank asks to stop after that step;
``LC_FAIL_AT=step@rank`` that rank raises a user error there.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import distrun

REC = os.environ.get("LC_REC", "")

#: a torchrun-style script that never destroys its process group (the tutorial's shape)
NEVER_DESTROYS = """\
import os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(10, 5))
opt = torch.optim.SGD(model.parameters(), lr=0.001)
for _ in range(20):
    opt.zero_grad()
    model(torch.randn(20, 10)).sum().backward()
    opt.step()
print("done", os.environ["RANK"], flush=True)
"""


def _at(name: str) -> tuple[int, int] | None:
    value = os.environ.get(name)
    if not value:
        return None
    step, _, rank = value.partition("@")
    return int(step), int(rank or 0)


class Batches:
    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


class Steps(distrun.Task):
    def configure_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def configure_optimizer(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.05)

    def train_data(self) -> Any:
        gen = torch.Generator().manual_seed(7)
        x, y = torch.randn(256, 8, generator=gen), torch.randn(256, 1, generator=gen)
        if os.environ.get("LC_UNEVEN"):
            rank = int(os.environ.get("RANK", "0"))
            return Batches([(x[i * 4:(i + 1) * 4], y[i * 4:(i + 1) * 4])
                            for i in range(12 + 4 * rank)])
        return torch.utils.data.TensorDataset(x, y)

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        time.sleep(float(os.environ.get("LC_SLEEP", "0")))
        x, y = batch
        return F.mse_loss(model(x), y)


def _record(kind: str, rank: int, **fields: Any) -> None:
    if REC:
        with open(os.path.join(REC, f"{kind}-{rank}.jsonl"), "a") as fh:
            fh.write(json.dumps({"pid": os.getpid(), **fields}) + "\n")


@distrun.hookimpl
def distrun_on_fit_start(run: Any) -> None:
    _record("start", run.rank, step=run.progress.step)


@distrun.hookimpl
def distrun_on_step_end(run: Any, step: int) -> None:
    _record("steps", run.rank, step=step)
    if _at("LC_STOP_AT") == (step, run.rank):
        run.request_stop()
    if _at("LC_FAIL_AT") == (step, run.rank):
        raise distrun.UsageError(f"rank {run.rank} was told to fail at step {step} (a test)")


def records(folder: str, kind: str, rank: int) -> list[dict[str, Any]]:
    path = os.path.join(folder, f"{kind}-{rank}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]
