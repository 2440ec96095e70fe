"""Tasks and the rank function of the tp tests: a residual MLP-block model and the tiny GPT."""

from __future__ import annotations

import importlib.util
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

import distrun
from distrun.testing import only_plugins

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny_gpt.py"


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, dim: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(8, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.out = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class BlocksTask(distrun.Task):
    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(128, 8, generator=gen)
        self.data = torch.utils.data.TensorDataset(x, torch.sin(x.sum(dim=1, keepdim=True)))

    def configure_model(self) -> nn.Module:
        return Net()

    def configure_optimizer(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=3e-3)

    def train_data(self) -> Any:
        return self.data

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(model(x), y)


def load_tiny_gpt() -> Any:
    """The examples/tiny_gpt.py module (imported by path, as `distrun run` would)."""
    spec = importlib.util.spec_from_file_location("tiny_gpt_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


class PlannedBlocksTask(BlocksTask):
    """A task that gives its own plan: only the first block is split."""

    def parallelize_plan(self, mesh: Any) -> dict[str, Any]:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        assert mesh.mesh_dim_names == ("tp",)
        return {"blocks.0.fc1": ColwiseParallel(), "blocks.0.fc2": RowwiseParallel()}


def make_task(name: str) -> Any:
    """``blocks``, or ``gpt``: the example's tiny GPT, small, with SGD.

    SGD for weight parity: Adam divides by the gradient's magnitude, so a gradient that is
    zero up to rounding (an unused embedding row) turns a 1e-9 difference into a full step.
    """
    if name == "blocks":
        return BlocksTask()
    if name == "planned":
        return PlannedBlocksTask()
    os.environ.setdefault("TINY_GPT_CHARS", "6000")
    os.environ.setdefault("TINY_GPT_DIM", "32")

    class SGDTinyGPT(load_tiny_gpt().TinyGPTTask):
        def configure_optimizer(self, params: Any) -> torch.optim.Optimizer:
            return torch.optim.SGD(params, lr=0.3, momentum=0.9)

    return SGDTinyGPT()


class Recorder:
    """Keeps the reduced loss of every logged step and, at the end, the full weights."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.final: dict[str, Any] = {}

    @distrun.hookimpl
    def distrun_log_metrics(self, run: Any, step: int, metrics: Any) -> None:
        if "loss" in metrics:
            self.losses.append(metrics["loss"])

    @distrun.hookimpl
    def distrun_on_fit_end(self, run: Any) -> None:
        from torch.distributed.tensor import DTensor

        state = {}
        for key, value in run.unwrapped_model().state_dict().items():
            if isinstance(value, DTensor):
                value = value.full_tensor()  # a collective: the group is still up here
            state[key] = value.detach().double().tolist()
        placements = {n: [repr(p) for p in v.placements] for n, v in
                      run.unwrapped_model().state_dict().items() if isinstance(v, DTensor)}
        self.final = {"state": state, "placements": placements}


def train(rank: int, world: int, task: str, options: dict[str, Any]) -> dict[str, Any]:
    """Train ``task`` with ``options`` on this rank; losses, full weights, data view."""
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    os.environ.pop("DISTRUN_CONFIG", None)
    if "port" in options:
        # a fresh store port per fit: a fast rank must not join the previous fit's store
        os.environ["MASTER_PORT"] = str(options.pop("port"))
    only_plugins(options.pop("plugins", "distrun_tp.plugin"))  # fresh: no earlier fit's plugins
    rec = Recorder()
    opts = dict(max_steps=5, batch_size=16, log_every_n_steps=1, summary=False, timeout=120.0)
    opts.update(options)
    run = distrun.Trainer(plugins=(rec,), **opts).fit(make_task(task))
    return {"losses": rec.losses, "dp": (run.strategy.dp_rank, run.strategy.dp_world_size),
            **rec.final}


def max_weight_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max((torch.tensor(a["state"][k]) - torch.tensor(b["state"][k])).abs().max().item()
               for k in a["state"])


def train_many(rank: int, world: int, runs: list[tuple[str, dict[str, Any]]]
               ) -> list[dict[str, Any]]:
    """Several (task, options) fits in this process (a fresh torch costs more than a fit)."""
    return [train(rank, world, task, dict(options)) for task, options in runs]


def reference(*lead: Any, options: dict[str, Any]) -> dict[str, Any]:
    """The same training in this process with the core's single strategy (env restored)."""
    saved = dict(os.environ)
    try:
        return train(0, 1, *lead, dict(options, strategy="single", plugins=""))
    finally:
        os.environ.clear()
        os.environ.update(saved)
