"""A tiny residual MLP-block model and the helpers the fsdp tests run on spawned ranks."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from torch import nn

import distrun
from distrun.testing import only_plugins


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


def make_data(n: int = 128, seed: int = 0) -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    return torch.utils.data.TensorDataset(x, y)


class BlocksTask(distrun.Task):
    def __init__(self, lr: float = 3e-3) -> None:
        self.lr = lr
        self.data = make_data()

    def configure_model(self) -> nn.Module:
        return Net()

    def configure_optimizer(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=self.lr)

    def train_data(self) -> Any:
        return self.data

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(model(x), y)


class Recorder:
    """A plugin keeping the reduced loss of every logged step and the final full weights."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.final: dict[str, Any] = {}
        self.grads_after: list[int] = []

    @distrun.hookimpl(wrapper=True)
    def distrun_backward(self, run: Any, loss: Any) -> Any:
        result = yield
        # how many parameters hold a gradient after this micro-step's backward
        self.grads_after.append(sum(p.grad is not None for p in run.model.parameters()))
        return result

    @distrun.hookimpl
    def distrun_on_fit_end(self, run: Any) -> None:
        # while the process group is still up: gathering DTensors is a collective
        self.final = {
            "state": full_state(run.unwrapped_model()),
            "param_types": sorted({type(p).__name__ for p in run.model.parameters()}),
            "mesh_timeouts": _mesh_timeouts(run),
            "backend": torch.distributed.get_backend() if torch.distributed.is_initialized()
            else None,
            "timeout": run.config.timeout,
            "local_numel": sum(_local(p).numel() for p in run.model.parameters()),
            "opt_numel": sum(_local(v).numel() for s in run.optimizer.state.values()
                             for v in s.values() if isinstance(v, torch.Tensor) and v.dim()),
            "placements": sorted({str(tuple(p.placements)) for p in run.model.parameters()
                                  if hasattr(p, "placements")}),
            "opt_state_types": sorted({type(v).__name__ for s in run.optimizer.state.values()
                                       for v in s.values() if isinstance(v, torch.Tensor)}),
        }

    @distrun.hookimpl
    def distrun_log_metrics(self, run: Any, step: int, metrics: Any) -> None:
        if "loss" in metrics:
            self.losses.append(metrics["loss"])


def _mesh_timeouts(run: Any) -> list[float | None]:
    """Each mesh group's collective timeout, as its backend tells it (gloo and nccl do; a
    plugin's backend may not: None. tests/core/test_backends.py checks the timeout reaches
    a plugin backend's sub-groups)."""
    mesh = getattr(run.strategy, "mesh", None)
    if mesh is None:
        return []
    out: list[float | None] = []
    for name in mesh.mesh_dim_names:
        opts = getattr(mesh.get_group(name)._get_backend(torch.device("cpu")), "options", None)
        out.append(opts._timeout.total_seconds() if opts is not None else None)
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def full_state(model: nn.Module) -> dict[str, list]:
    """The model's state_dict as nested lists (DTensors gathered): safe to send to the parent."""
    from torch.distributed.tensor import DTensor

    out = {}
    for key, value in model.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        out[key] = value.detach().double().tolist()
    return out


def train(rank: int, world: int, options: dict[str, Any]) -> dict[str, Any]:
    """Train BlocksTask with ``options`` on this rank; the losses and full final weights."""
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    os.environ.pop("DISTRUN_CONFIG", None)
    if "port" in options:
        # a fresh store port per fit: a fast rank must not join the previous fit's store
        os.environ["MASTER_PORT"] = str(options.pop("port"))
    # only the plugins under test (not whatever else is installed)
    only_plugins(options.pop("plugins", "distrun_fsdp.plugin"))  # fresh: no earlier fit's plugins
    rec = Recorder()
    opts = dict(max_steps=6, batch_size=16, log_every_n_steps=1, summary=False,
                timeout=120.0, run_dir=options.pop("run_dir", "runs/fsdp-test"))
    opts.update(options)
    run = distrun.Trainer(plugins=(rec,), **opts).fit(BlocksTask())
    return {"losses": rec.losses, "dp": (run.strategy.dp_rank, run.strategy.dp_world_size),
            "grads_after": rec.grads_after, **rec.final}


def max_weight_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max((torch.tensor(a["state"][k]) - torch.tensor(b["state"][k])).abs().max().item()
               for k in a["state"])


def train_many(rank: int, world: int, *args: Any) -> list[dict[str, Any]]:
    """Several fits in this process (starting torch per fit costs more than a tiny fit)."""
    *lead, runs = args
    return [train(rank, world, *lead, dict(options)) for options in runs]


def reference(*lead: Any, options: dict[str, Any]) -> dict[str, Any]:
    """The same training in this process with the core's single strategy (env restored)."""
    saved = dict(os.environ)
    try:
        return train(0, 1, *lead, dict(options, strategy="single", plugins=""))
    finally:
        os.environ.clear()
        os.environ.update(saved)
