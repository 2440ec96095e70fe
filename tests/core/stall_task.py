"""A task whose rank ``STALL_RANK`` (default 1) hangs at its ``STALL_AT``-th call of one part
of the step, for the stall tests: ``STALL_IN`` = ``step`` (training_step), ``data`` (the
dataset), ``validation`` (validation_step) or ``checkpoint`` (:mod:`stall_plugin`'s state,
read while a checkpoint is saved). The hang is a sleep; ``STALL_MARK``: the file the rank
writes the time it started hanging to. With ``STALL_ONCE`` only the first attempt
(``TORCHELASTIC_RESTART_COUNT`` 0) hangs; with ``STALL_HOW=stop`` the rank stops itself
(SIGSTOP) instead of sleeping, with ``STALL_HOW=spin`` it spins (a livelock, or long work:
``STALL_FOR`` seconds, then it goes on; default 600). ``SLOW_MS``: that rank's training_step takes
this many milliseconds longer at every step instead (a straggler)."""

from __future__ import annotations

import os
import signal
import time

import torch
from torch import nn

import distrun

_calls: dict[str, int] = {}


def hang_here(part: str) -> None:
    """Hang if this rank is to hang at this call of ``part``."""
    _calls[part] = _calls.get(part, 0) + 1
    if os.environ.get("STALL_IN") != part or _calls[part] != int(os.environ.get("STALL_AT", "20")):
        return
    if os.environ.get("RANK") != os.environ.get("STALL_RANK", "1"):
        return
    if os.environ.get("STALL_ONCE") and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    with open(os.environ["STALL_MARK"], "w") as fh:
        fh.write(repr(time.time()))
    if os.environ.get("STALL_HOW") == "stop":  # a process that answers nothing, not even
        os.kill(os.getpid(), signal.SIGSTOP)   # a question of another node's watcher
    if os.environ.get("STALL_HOW") == "spin":  # a livelock (or long work): it burns CPU
        end = time.monotonic() + float(os.environ.get("STALL_FOR", "600"))
        while time.monotonic() < end:
            pass
        return
    time.sleep(600)  # stands for a deadlock


class Samples(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=gen)
        self.y = self.x.sum(1, keepdim=True)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        if i == 0 or os.environ.get("STALL_IN") == "data":
            hang_here("data")
        return self.x[i], self.y[i]


class StallTask(distrun.Task):
    def configure_model(self) -> nn.Module:
        # a block (8 -> 16 -> 8) and a head: --strategy tp finds a pair of layers to split
        return nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)),
                             nn.Linear(8, 1))

    def configure_optimizer(self, params):
        return torch.optim.SGD(params, lr=0.01)

    def train_data(self):
        return Samples(2048, 0)

    def val_data(self):
        return Samples(256, 1)

    def training_step(self, model, batch):
        hang_here("step")
        if os.environ.get("SLOW_MS") and os.environ.get("RANK") == os.environ.get("STALL_RANK", "1"):
            time.sleep(float(os.environ["SLOW_MS"]) / 1e3)
        x, y = batch
        return nn.functional.mse_loss(model(x), y)

    def validation_step(self, model, batch):
        hang_here("validation")
        x, y = batch
        return {"loss": nn.functional.mse_loss(model(x), y)}
