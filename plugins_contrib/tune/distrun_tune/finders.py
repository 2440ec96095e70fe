"""What both finders share: the run's own training step, agreement across ranks, and putting
the model and optimizer back as they were.

A finder's step is the fit's step: the task's ``training_step`` through the hook (so autocast
and other wrappers apply), the strategy's backward (DDP's all-reduce, FSDP's reduce-scatter)
and its optimizer step. Each rank decides nothing alone: the loss a step saw and whether a
trial fitted are reduced across ranks first, so every rank takes the same next step.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

from distrun.plugin import UsageError

__all__ = ["Snapshot", "agree", "ranks", "run_finder", "to_device", "train_step", "write_result"]

log = logging.getLogger("distrun")


def to_device(batch: Any, device: torch.device) -> Any:
    """Tensors in nested lists, tuples and dicts moved to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return type(batch)({k: to_device(v, device) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, (list, tuple)):
        moved = [to_device(v, device) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch


def train_step(run: Any, batch: Any) -> torch.Tensor:
    """One optimizer step on ``batch`` as the fit takes it; the loss (detached)."""
    loss = run.hook.distrun_training_step(run=run, batch=to_device(batch, run.device))
    if isinstance(loss, Mapping):
        loss = loss["loss"]
    if not isinstance(loss, torch.Tensor):
        raise UsageError(f"{type(run.task).__name__}.training_step(model, batch) returned "
                         f"{type(loss).__name__}; it must return the loss as a torch.Tensor")
    run.hook.distrun_backward(run=run, loss=loss)
    run.hook.distrun_optimizer_step(run=run)
    run.optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def agree(run: Any, value: float, op: str) -> float:
    """``value`` reduced over every rank: ``"mean"``, ``"max"`` or ``"min"``."""
    tensor = torch.tensor([value], dtype=torch.float64, device=run.device)
    run.strategy.all_reduce(tensor, "sum" if op == "mean" else op)
    out = float(tensor.item())
    return out / run.world_size if op == "mean" else out


class Snapshot:
    """The model's, the optimizer's and the sampler's state now, to put back after the
    finder's steps."""

    def __init__(self, run: Any) -> None:
        self.model = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
        self.optimizer = copy.deepcopy(run.optimizer.state_dict())
        self.sampler = run.sampler.state_dict() if run.sampler is not None else None

    def restore(self, run: Any) -> None:
        run.model.load_state_dict(self.model)
        run.optimizer.load_state_dict(self.optimizer)
        run.optimizer.zero_grad(set_to_none=True)
        if self.sampler is not None:
            run.sampler.load_state_dict(self.sampler)


def ranks(n: int) -> str:
    """``1 rank``, ``2 ranks``."""
    return f"{n} rank{'s' if n != 1 else ''}"


def tune_dir(run: Any) -> str:
    """Where the finders write (``RUN_DIR/tune``; ``./tune`` for a run without a folder)."""
    return os.path.join(run.run_dir or ".", "tune")


def write_result(run: Any, name: str, result: dict[str, Any]) -> str:
    """Rank 0 writes ``NAME.json`` next to the plot; the path."""
    path = os.path.join(tune_dir(run), f"{name}.json")
    if run.is_global_zero:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(result, fh, indent=2)
            fh.write("\n")
        os.replace(tmp, path)  # never a half-written result
    return path


def run_finder(run: Any, finder: str) -> dict[str, Any]:
    """The finder ``--tune`` names, instead of the fit; its result (also in
    ``run.results["tune"]``). The model and optimizer end as they started."""
    if run.train_loader is None:
        raise UsageError(f"--tune {finder}: {type(run.task).__name__} has no train_data() "
                         "to tune on")
    snapshot = Snapshot(run)
    model = run.model
    model.train()
    try:
        if finder == "lr":
            from distrun_tune.lr_find import lr_range_test

            result = lr_range_test(run)
        else:
            from distrun_tune.batch_find import find_batch_size

            result = find_batch_size(run)
    finally:
        snapshot.restore(run)
    run.results["tune"] = result
    run.done = True  # no training follows a finder in this run
    return result
