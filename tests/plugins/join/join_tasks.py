"""Uneven tasks, a strategy without a Joinable, and rank functions for the join tests."""

from __future__ import annotations

import os
import signal
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import distrun
from distrun.plugin import BaseStrategy


class Batches:
    """A plain iterable of batches (no ``__getitem__``): the core uses it as-is per rank."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


class Uneven(distrun.Task):
    """Rank r trains on ``counts[r]`` batches of 4 samples; Adam, so optimizer state matters."""

    def __init__(self, counts: tuple[int, ...] = (5, 8)) -> None:
        self.counts = counts

    def configure_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))

    def configure_optimizer(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=0.01)

    def train_data(self) -> Batches:
        rank = int(os.environ.get("RANK", "0"))
        gen = torch.Generator().manual_seed(100 + rank)
        return Batches([(torch.randn(4, 6, generator=gen), torch.randn(4, 1, generator=gen))
                        for _ in range(self.counts[rank])])

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(model(x), y)


class ManualAllReduce(BaseStrategy):
    """A data-parallel strategy with no Joinable: gradients all-reduced before each step."""

    name = "manual_allreduce"

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= self.world_size
        optimizer.step()


class StrategyPlugin:
    @distrun.hookimpl
    def distrun_register_strategies(self, register: Any) -> None:
        register(distrun.StrategyInfo("manual_allreduce", ManualAllReduce, plugin="test"))


PLUGIN = StrategyPlugin()


class StopAndRecord:
    """Records the steps metrics were logged at; asks one rank to stop after a given step.

    ``kind`` "request" is early stopping (``run.request_stop()``), "signal" a preemption as
    the signal handler records it (``run.stop_signal``).
    """

    def __init__(self, stop_at: tuple[int, int, str] | None) -> None:
        self.stop_at = stop_at
        self.logged: list[int] = []

    @distrun.hookimpl
    def distrun_log_metrics(self, run: Any, step: int, metrics: Any) -> None:
        if "loss" in metrics:
            self.logged.append(step)

    @distrun.hookimpl
    def distrun_on_step_end(self, run: Any, step: int) -> None:
        if self.stop_at is None:
            return
        rank, at, kind = self.stop_at
        if run.rank == rank and step == at:
            if kind == "request":
                run.request_stop()
            else:
                run.stop_signal = int(signal.SIGTERM)


def fit_uneven(rank: int, world: int, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fit ``Uneven`` once per options dict; per run: flat parameters, steps, or the error."""
    out = []
    for options in runs:
        options = dict(options)
        counts = options.pop("counts", (5, 8))
        recorder = StopAndRecord(options.pop("stop_at", None))
        trainer = distrun.Trainer(plugins=(PLUGIN, recorder), summary=False, debug=True,
                                  **options)
        try:
            run = trainer.fit(Uneven(counts))
        except distrun.DistrunError as exc:
            out.append({"error": str(exc)})
            continue
        except SystemExit as exc:  # a preemption: checkpoint saved, exit for requeue
            out.append({"exit": exc.code, "logged": recorder.logged})
            continue
        flat = torch.cat([_full(p).detach().flatten()
                          for p in run.unwrapped_model().parameters()])
        out.append({"params": flat, "steps": run.progress.step, "logged": recorder.logged,
                    "micro_steps": run.progress.micro_step, "strategy": run.strategy.name})
    return out


def _full(p: torch.Tensor) -> torch.Tensor:
    """The whole parameter: FSDP's are DTensor shards (gathering is a collective: all ranks)."""
    full = getattr(p, "full_tensor", None)
    return full() if full is not None else p
