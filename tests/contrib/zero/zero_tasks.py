"""Tasks and rank functions for the distrun-zero tests."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import distrun

_KEEP: list[Any] = []


class Blocks(distrun.Task):
    """Eight equal linear blocks, so ZeRO's size-greedy partition splits them evenly."""

    def __init__(self, uneven: tuple[int, int] | None = None, adamw: bool = False) -> None:
        self.adamw = adamw
        gen = torch.Generator().manual_seed(7)
        self.x = torch.randn(128, 32, generator=gen)
        self.y = torch.randn(128, 32, generator=gen)
        self.uneven = uneven

    def configure_model(self) -> nn.Module:
        layers: list[nn.Module] = []
        for _ in range(8):
            layers += [nn.Linear(32, 32), nn.Tanh()]
        return nn.Sequential(*layers)

    def configure_optimizer(self, params: Any) -> torch.optim.Optimizer:
        if self.adamw:  # its defaults hold a key its constructor refuses (torch >= 2.6)
            return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
        return torch.optim.Adam(params, lr=1e-3)

    def train_data(self) -> Any:
        if self.uneven is None:
            return torch.utils.data.TensorDataset(self.x, self.y)
        count = self.uneven[int(os.environ.get("RANK", "0"))]
        return _Batches([(self.x[i * 8:(i + 1) * 8], self.y[i * 8:(i + 1) * 8])
                         for i in range(count)])

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(model(x), y)


class TwoOptimizers(Blocks):
    """Manual optimization with two optimizers, one per half of the blocks (a GAN's shape)."""

    automatic_optimization = False

    def configure_optimizers(self, model: nn.Module) -> list[torch.optim.Optimizer]:
        params = list(model.parameters())
        half = len(params) // 2
        return [torch.optim.Adam(params[:half], lr=1e-3), torch.optim.Adam(params[half:], lr=1e-3)]

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(model(x), y)
        for opt in self.optimizers():
            opt.zero_grad()
        self.manual_backward(loss)
        for opt in self.optimizers():
            opt.step()
        return loss


class _Batches:
    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


def fit_zero(rank: int, world: int, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fit ``Blocks`` per options dict; weights, optimizer class, state bytes, full state."""
    from distrun_zero.zero import state_bytes

    out = []
    for options in runs:
        options = dict(options)
        uneven = options.pop("uneven", None)
        adamw = options.pop("adamw", False)
        run = distrun.Trainer(summary=False, **options).fit(Blocks(uneven, adamw))
        _KEEP.append(run)
        opt = run.optimizer
        full = opt.state_dict()  # collective under ZeRO: every rank gets the whole state
        out.append({
            "weights": {k: v.detach().clone()
                        for k, v in run.unwrapped_model().state_dict().items()},
            "optimizer": type(opt).__name__,
            "state_bytes": state_bytes(opt),
            "full_state": full,
            "steps": run.progress.step,
            "layout": run.state_dict().get("zero"),
        })
        if type(opt).__name__ == "ZeroOptimizer":
            # a plain torch.optim state dict loads back into the sharded optimizer
            opt.load_state_dict(full)
            out[-1]["bytes_after_load"] = state_bytes(opt)
    return out


def main() -> None:
    """`distrun run ... zero_tasks.py OUT`: train ``Blocks``; rank 0 saves the plain weights."""
    import sys

    run = distrun.fit(Blocks(), summary=False)
    if run.is_global_zero:
        torch.save({k: v.detach() for k, v in run.unwrapped_model().state_dict().items()},
                   sys.argv[1])


if __name__ == "__main__":
    main()
