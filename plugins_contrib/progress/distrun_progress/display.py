"""The two displays of distrun-progress: a rich bar and plain periodic lines.

Both show epoch, step of total, loss, samples/s and ETA. The loss and samples/s are the
values reduced across ranks at the last log step (``--log-every-n-steps``), so the bar never
forces a device sync of its own; lines mode reads rank 0's loss when it prints.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Mapping
from typing import IO, Any

from distrun.plugin import keys
from distrun_progress.options import ProgressOptions

#: the launcher passes its terminal to rank 0 in this variable (workers' stdout is a pipe)
TTY_ENV = "DISTRUN_PROGRESS_TTY"

__all__ = ["BarDisplay", "LinesDisplay", "Tracker", "make_display", "total_steps"]


def total_steps(run: Any) -> int | None:
    """Optimizer steps the fit will run (None when the data has no length and no max_steps)."""
    cfg = run.config
    accum = cfg.grad_accum
    total: int | None = None
    try:
        if run.sampler is not None:
            per_epoch = math.ceil(run.sampler.batches_per_epoch / accum)
            now = math.ceil(len(run.sampler) / accum)
        else:
            per_epoch = now = math.ceil(len(run.train_loader) / accum)
        epochs_after = max(0, cfg.max_epochs - run.progress.epoch - 1)
        total = run.progress.step + now + per_epoch * epochs_after
    except TypeError:  # an iterable without len()
        pass
    if cfg.max_steps >= 0:
        total = cfg.max_steps if total is None else min(total, cfg.max_steps)
    return total


def _clock(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Tracker:
    """Where the fit is and how fast it goes: steps, rate, ETA, last reduced metrics."""

    def __init__(self, run: Any) -> None:
        self.total = total_steps(run)
        self.max_epochs = run.config.max_epochs
        self.global_batch = run.config.batch_size * run.config.grad_accum
        self.first_step = run.progress.step
        self.step = run.progress.step
        self.epoch = run.progress.epoch
        self.started = time.monotonic()
        self.metrics: dict[str, float] = {}
        #: under --compile, the core's clock of compile time: compiling is left out of the
        #: rate (and so of the ETA), not of the elapsed time shown
        self.compile_clock = run.stash.get(keys.COMPILE_TIME)
        self.compiled_before = self.compile_clock.excluded if self.compile_clock else 0.0

    def update(self, step: int, epoch: int) -> None:
        self.step, self.epoch = step, epoch

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    @property
    def training_time(self) -> float:
        """Elapsed seconds less those spent compiling (torch.compile) since the fit started."""
        if self.compile_clock is None:
            return self.elapsed
        return self.elapsed - (self.compile_clock.excluded - self.compiled_before)

    @property
    def steps_per_sec(self) -> float | None:
        done, seconds = self.step - self.first_step, self.training_time
        return done / seconds if done > 0 and seconds > 0 else None

    @property
    def samples_per_sec(self) -> float | None:
        if "samples_per_sec" in self.metrics:
            return self.metrics["samples_per_sec"]
        rate = self.steps_per_sec
        return rate * self.global_batch if rate is not None else None

    @property
    def eta(self) -> float | None:
        rate = self.steps_per_sec
        if self.total is None or rate is None:
            return None
        return max(0, self.total - self.step) / rate

    def stats(self, loss: float | None = None, val: bool = True) -> str:
        """``loss 0.1234 | 812.3 samples/s`` plus the last ``val_*`` values when ``val``."""
        loss = self.metrics.get("loss") if loss is None else loss
        parts = [f"loss {loss:.4f}" if loss is not None else "loss -"]
        rate = self.samples_per_sec
        parts.append(f"{rate:.1f} samples/s" if rate is not None else "- samples/s")
        if val:
            parts += [f"{k} {v:.4f}" for k, v in self.metrics.items() if k.startswith("val_")]
        return " | ".join(parts)

    def epoch_text(self) -> str:
        return f"epoch {min(self.epoch + 1, self.max_epochs)}/{self.max_epochs}"

    def step_text(self) -> str:
        if self.total:
            return f"step {self.step}/{self.total} ({100.0 * self.step / self.total:.0f}%)"
        return f"step {self.step}"


class LinesDisplay:
    """A plain line every ``interval`` seconds (and at the end): for CI logs and pipes."""

    def __init__(self, run: Any, stream: IO[str], interval: float) -> None:
        self.tracker = Tracker(run)
        self.stream = stream
        self.interval = interval
        self.last_print = -math.inf
        self.last_step = -1

    def _line(self, loss: float | None = None) -> str:
        t = self.tracker
        return (f"[progress] {t.epoch_text()} | {t.step_text()} | {t.stats(loss)} | "
                f"elapsed {_clock(t.elapsed)} | ETA {_clock(t.eta)}")

    def _print(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()

    def on_step(self, run: Any, step: int, metrics: Mapping[str, Any]) -> None:
        self.tracker.update(step, int(metrics.get("epoch", run.progress.epoch)))
        now = time.monotonic()
        if now - self.last_print < self.interval:
            return
        self.last_print, self.last_step = now, step
        loss = metrics.get("loss")
        self._print(self._line(float(loss) if loss is not None else None))

    def on_metrics(self, run: Any, step: int, metrics: Mapping[str, float]) -> None:
        self.tracker.metrics.update(metrics)
        val = {k: v for k, v in metrics.items() if k.startswith("val_")}
        if val:
            text = " | ".join(f"{k} {v:.4f}" for k, v in val.items())
            self._print(f"[progress] validation at step {step} | {text}")

    def finish(self, run: Any) -> None:
        if self.last_step != self.tracker.step:
            self._print(self._line())
        self.last_step = self.tracker.step

    def close(self) -> None:
        return None


class BarDisplay:
    """A rich progress bar: epoch, step/total, loss, samples/s and ETA."""

    def __init__(self, run: Any, stream: IO[str], owns_stream: bool) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        self.tracker = Tracker(run)
        self.stream, self.owns_stream = stream, owns_stream
        on_stdout = stream is sys.stdout
        self.console = Console(file=stream, force_terminal=True)
        # One line that fits 80 columns; validation results print above it as they come.
        self.progress = Progress(
            TextColumn("{task.fields[epoch]}"), BarColumn(bar_width=20), MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"), TextColumn("ETA"), TimeRemainingColumn(),
            console=self.console, refresh_per_second=4,
            redirect_stdout=on_stdout, redirect_stderr=on_stdout,
        )
        t = self.tracker
        self.task = self.progress.add_task("train", total=t.total, completed=t.step,
                                           epoch=t.epoch_text(), stats=t.stats(val=False))
        self.progress.start()

    def on_step(self, run: Any, step: int, metrics: Mapping[str, Any]) -> None:
        self.tracker.update(step, int(metrics.get("epoch", run.progress.epoch)))
        self.progress.update(self.task, completed=step, epoch=self.tracker.epoch_text())

    def on_metrics(self, run: Any, step: int, metrics: Mapping[str, float]) -> None:
        self.tracker.metrics.update(metrics)
        val = {k: v for k, v in metrics.items() if k.startswith("val_")}
        if val:
            text = " | ".join(f"{k} {v:.4f}" for k, v in val.items())
            self.progress.console.print(f"validation at step {step} | {text}",
                                        highlight=False)
        self.progress.update(self.task, stats=self.tracker.stats(val=False))

    def finish(self, run: Any) -> None:
        self.progress.update(self.task, completed=self.tracker.step,
                             stats=self.tracker.stats(val=False))

    def close(self) -> None:
        if self.tracker.step == self.tracker.first_step:
            # A fit that took no step (a finder ran instead, or it resumed at its end): an
            # empty bar says nothing, so it goes rather than stay as a stale `0/N` frame.
            self.progress.live.transient = True
        self.progress.stop()
        if self.owns_stream:
            self.stream.close()


def _open_tty(path: str | None) -> IO[str] | None:
    if not path:
        return None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NOCTTY)
    except OSError:
        return None
    return os.fdopen(fd, "w", buffering=1)


def make_display(run: Any) -> BarDisplay | LinesDisplay:
    """A bar when rank 0 can draw on a terminal (or ``--progress-mode bar``), else lines."""
    opts = ProgressOptions.of(run.config)
    mode = opts.progress_mode
    if mode != "lines":
        if sys.stdout.isatty():
            return BarDisplay(run, sys.stdout, owns_stream=False)
        tty = _open_tty(os.environ.get(TTY_ENV))
        if tty is not None:
            return BarDisplay(run, tty, owns_stream=True)
        if mode == "bar":
            return BarDisplay(run, sys.stdout, owns_stream=False)
    return LinesDisplay(run, sys.stdout, opts.progress_interval)
