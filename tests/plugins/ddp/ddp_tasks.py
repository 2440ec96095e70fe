"""Tasks and rank functions for the distrun-ddp tests (also a script for `distrun run`)."""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import distrun

N_SAMPLES = 192
_KEEP: list[Any] = []


class Regression(distrun.Task):
    """A small MLP on fixed random data: no dropout, so every strategy computes the same."""

    def __init__(self, width: int = 32, momentum: float = 0.9) -> None:
        gen = torch.Generator().manual_seed(1234)
        self.x = torch.randn(N_SAMPLES, 12, generator=gen)
        self.y = torch.randn(N_SAMPLES, 1, generator=gen)
        self.width = width
        self.momentum = momentum

    def configure_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(12, self.width), nn.Tanh(), nn.Linear(self.width, 1))

    def configure_optimizer(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.05, momentum=self.momentum)

    def train_data(self) -> Any:
        return torch.utils.data.TensorDataset(self.x, self.y)

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(model(x), y)


class WithUnused(Regression):
    """A model whose second head never gets a gradient (needs find_unused_parameters)."""

    def configure_model(self) -> nn.Module:
        return _TwoHeads(super().configure_model())


class _TwoHeads(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body
        self.unused = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def plain_weights(run: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in run.unwrapped_model().state_dict().items()}


def fit_many(rank: int, world: int, runs: list[dict[str, Any]], task_kwargs: dict[str, Any]
             ) -> list[dict[str, Any]]:
    """Fit the Regression task once per options dict in this process; per run: weights, facts."""
    out = []
    for options in runs:
        options = dict(options)
        task_cls = WithUnused if options.pop("unused", False) else Regression
        count = options.pop("count_allreduce", False)
        plugins = (_CountingHook(),) if count else ()
        expect_error = options.pop("expect_error", False)
        try:
            run = distrun.Trainer(plugins=plugins, summary=False, **options).fit(
                task_cls(**task_kwargs))
        except RuntimeError as exc:
            if not expect_error:
                raise
            out.append({"error": str(exc)})
            continue
        model = run.model
        facts = {
            "wrapped": type(model).__name__,
            "steps": run.progress.step,
            "keys": list(run.unwrapped_model().state_dict()),
            "allreduces": plugins[0].calls if count else None,
        }
        for attr in ("find_unused_parameters", "static_graph", "gradient_as_bucket_view",
                     "broadcast_buffers", "forward_sync_buffers", "bucket_bytes_cap"):
            if hasattr(model, attr):
                facts[attr] = getattr(model, attr)
        out.append({"weights": plain_weights(run), **facts})
        # Keep finished runs alive: tearing down a DDP with a Python comm hook mid-process is
        # not what these tests are about; the spawned process exits without destructors.
        _KEEP.append(run)
        if plugins:
            run.pm.unregister(plugins[0])
    return out


class _CountingHook:
    """A test plugin: counts DDP bucket all-reduces with a comm hook that still all-reduces."""

    def __init__(self) -> None:
        self.calls = 0

    @distrun.hookimpl(trylast=True)
    def distrun_setup_model(self, run: Any) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        def hook(state, bucket):  # unannotated: DDP checks annotations if present
            self.calls += 1
            return default_hooks.allreduce_hook(state, bucket)

        run.model.register_comm_hook(None, hook)


def main() -> None:
    """`distrun run ... ddp_tasks.py --out FILE`: train, then rank 0 saves the plain weights."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    run = distrun.fit(Regression(), summary=False)
    if run.is_global_zero:
        torch.save(plain_weights(run), args.out)
    print(f"rank {run.rank} done: strategy {run.strategy.name}, model "
          f"{type(run.model).__name__}, steps {run.progress.step}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
