"""distrun's side of ``benchmarks/multinode.py``'s slow-link trials, and a plugin timing them.

``LinkTask``: the hand-written loop's model, data, optimizer and loss (``_multinode_plain``) as a
:class:`distrun.Task`, for ``distrun run --strategy ddp --batch-size 64``. Loaded as a plugin
(``DISTRUN_PLUGINS=_multinode_task``), this module times the steps after the warm-up the same
way the hand-written loop does, and rank 0 writes the steps/s to ``$BENCH_OUT``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from _multinode_plain import LINK_MODEL, link_data, mlp

import distrun
from distrun.plugin import hookimpl

WARMUP = int(os.environ.get("BENCH_WARMUP", "10"))
STEPS = int(os.environ.get("BENCH_STEPS", "50"))


class LinkTask(distrun.Task):
    def configure_model(self) -> Any:
        return mlp(*LINK_MODEL)

    def configure_optimizer(self, params: Any) -> Any:
        import torch

        return torch.optim.SGD(params, lr=0.01)

    def train_data(self) -> Any:
        return link_data(STEPS)

    def training_step(self, model: Any, batch: Any) -> Any:
        import torch.nn.functional as F

        x, y = batch
        return F.cross_entropy(model(x), y)


_times: dict[str, float] = {}


@hookimpl
def distrun_on_step_end(run: Any, step: int) -> None:
    if step == WARMUP:
        _times["start"] = time.perf_counter()
    _times["end"] = time.perf_counter()
    _times["steps"] = step


@hookimpl
def distrun_on_fit_end(run: Any) -> None:
    if run.rank == 0 and "start" in _times:
        rate = (_times["steps"] - WARMUP) / (_times["end"] - _times["start"])
        with open(os.environ["BENCH_OUT"], "w") as fh:
            json.dump({"steps_per_s": rate}, fh)
