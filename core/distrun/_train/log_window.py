"""The log window: the loss and sample counts the steps gathered since the last log row, kept
as tensors (no per-step sync), and their packing for the step sync's reduction over ranks."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from distrun._spec.keys import STEP_SYNC
from distrun._spec.stash import StashKey
from distrun._train.metrics import Accumulator
from distrun._train.run import Run


class _Window:
    """Loss and sample counts since the last log, kept as tensors (no per-step sync)."""

    #: losses kept before they are summed into one tensor (bounds the memory of long windows)
    FOLD = 64

    def __init__(self, clock: Any = None) -> None:
        #: what the steps log per log row (names persist across rows: see metrics.py)
        self.logged = Accumulator()
        #: the torch.compile clock (--compile), whose time samples/s leaves out
        self.clock = clock
        #: the epoch the steps in the window trained in (set as each epoch starts)
        self.epoch = 0
        self.reset()
        if clock is not None:
            clock.mark_step()  # the fit's first step starts

    def reset(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.folded: torch.Tensor | None = None
        self.micro = 0
        self.samples = 0
        self.started = time.perf_counter()
        #: under --compile: the clock's seconds at the reset, and those compiled during
        #: validation since (validation's whole time is left out already)
        self.compiled_at_reset = self.clock.excluded if self.clock is not None else 0.0
        self.compiled_in_validation = 0.0

    def add_loss(self, loss: torch.Tensor) -> None:
        """Keep the step's loss (a list append: the sum is taken at the log step)."""
        self.losses.append(loss.detach())
        if len(self.losses) >= self.FOLD:
            self.folded = self.total()
            self.losses = []

    def total(self) -> torch.Tensor:
        """The sum of the losses so far, in float64, on their device (0 when there is none)."""
        parts = [_sum(self.losses)] if self.losses else []
        if self.folded is not None:
            parts.append(self.folded)
        if not parts:
            return torch.zeros((), dtype=torch.float64)
        return parts[0] if len(parts) == 1 else parts[0] + parts[1]


def _sum(losses: list[torch.Tensor]) -> torch.Tensor:
    try:
        return torch.stack(losses).to(torch.float64).sum()
    except RuntimeError:  # losses of different shapes or devices: one at a time
        return sum((t.to(torch.float64).sum() for t in losses), torch.zeros((), dtype=torch.float64,
                                                                           device=losses[0].device))


#: the loop's log window on the run
_WINDOW: StashKey[_Window] = StashKey("loop.window")


def _pack_window(run: Run, step: int) -> tuple[torch.Tensor, Callable[[torch.Tensor], None]]:
    """The window since the last log as values to sum over ranks, and what logs the sums as
    ``step`` (the step sync sends them with its vote and calls ``done`` at the next boundary,
    so no rank waits on them)."""
    window = run.stash[_WINDOW]
    loss = window.total()
    packed = torch.stack([  # on the loss's device: no host sync here
        loss.reshape(()),
        torch.tensor(float(window.micro), dtype=torch.float64, device=loss.device),
        torch.tensor(float(window.samples), dtype=torch.float64, device=loss.device)])
    logged = window.logged
    if logged:
        packed = torch.cat([packed, logged.pack(loss.device)])
    elapsed = time.perf_counter() - window.started
    compile_s = None
    clock = window.clock
    if clock is not None:  # compiling is no ordinary step: out of samples/s, in compile_s
        elapsed -= clock.excluded - window.compiled_at_reset - window.compiled_in_validation
        compile_s = clock.take_unlogged() or None
    elapsed = max(elapsed, 1e-9)
    window.reset()
    epoch = float(window.epoch)
    lr = None
    if run.optimizer is not None and run.optimizer.param_groups:
        lr = float(run.optimizer.param_groups[0].get("lr", 0.0))

    def done(summed: torch.Tensor) -> None:
        loss_sum, micro, samples = summed[:3].tolist()
        if micro == 0 and samples == 0:
            return
        metrics = {
            # ranks of one data-parallel replica (TP) saw the same samples: count them once
            "samples_per_sec": samples / elapsed * run.strategy.dp_world_size / run.world_size,
            "epoch": epoch,
            "step": float(step),
        }
        if micro:  # (a manual step may return no loss)
            metrics = {"loss": loss_sum / micro, **metrics}
        if lr is not None:
            metrics["lr"] = lr
        if compile_s is not None:
            metrics["compile_s"] = compile_s
        sync = run.stash.get(STEP_SYNC)
        spread = sync.times.spread if sync is not None else None
        if spread is not None:  # the ranks' compute time per step (distrun._diagnose.straggler)
            metrics.update(slowest_rank=float(spread.slowest_rank),
                           slowest_compute_ms=spread.slowest * 1e3,
                           fastest_compute_ms=spread.fastest * 1e3)
        if summed.numel() > 3:
            metrics.update(logged.unpack(summed[3:]))
        run.metrics.update(metrics)
        run.hook.distrun_log_metrics(run=run, step=step, metrics=metrics)

    return packed, done
