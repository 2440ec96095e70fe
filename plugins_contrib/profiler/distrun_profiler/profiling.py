"""The profiler of one rank's fit: ``torch.profiler`` stepped at each optimizer step."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from distrun.plugin import hookimpl
from distrun_profiler.options import ProfilerOptions

__all__ = ["StepProfiler", "top_ops", "trace_dir"]


def trace_dir(run: Any) -> str:
    """``--profile-dir``, else ``RUN_DIR/profiler``."""
    return ProfilerOptions.of(run.config).profile_dir or os.path.join(run.run_dir or ".", "profiler")


def top_ops(events: Any, count: int, device: bool = False) -> list[tuple[str, float, float]]:
    """The ``count`` ops with the most self time: (name, milliseconds, share of all)."""
    attr = "self_device_time_total" if device else "self_cpu_time_total"
    rows = [(e.key, float(getattr(e, attr, 0.0))) for e in events
            if not e.key.startswith("ProfilerStep")]
    total = sum(us for _, us in rows) or 1.0
    rows.sort(key=lambda r: r[1], reverse=True)
    return [(name, us / 1e3, us / total) for name, us in rows[:count] if us > 0]


class StepProfiler:
    """Wait, warm up, record: one cycle of ``torch.profiler``'s schedule over training steps,
    then the trace of this rank is written and the profiler lets go of the loop.

    Registered for the fit with ``run.add_hooks`` (its ``distrun_on_step_end`` steps the
    profiler), only when ``--profile`` is on.
    """

    def __init__(self, run: Any) -> None:
        cfg = ProfilerOptions.of(run.config)
        self.wait, self.warmup = int(cfg.profile_wait), int(cfg.profile_warmup)
        self.active = int(cfg.profile_steps)
        self.total = self.wait + self.warmup + self.active
        #: the first global step recorded (steps count from the fit's start)
        self.first = run.progress.step + self.wait + self.warmup + 1
        self.dir = trace_dir(run)
        self.worker = f"{socket.gethostname()}_rank{run.rank}"
        self.top = int(cfg.profile_top)
        self.device = torch.cuda.is_available() and run.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device else [])
        self.prof: Any = profile(
            activities=activities,
            schedule=schedule(wait=self.wait, warmup=self.warmup, active=self.active, repeat=1),
            on_trace_ready=self._write, record_shapes=bool(cfg.profile_shapes),
            profile_memory=bool(cfg.profile_memory), with_stack=bool(cfg.profile_stack))
        self.steps = 0
        #: the trace file, once written
        self.trace: str | None = None

    def start(self) -> None:
        self.prof.start()

    def _write(self, prof: Any) -> None:
        # the layout of torch's tensorboard_trace_handler: WORKER.MILLISECONDS.pt.trace.json
        os.makedirs(self.dir, exist_ok=True)
        path = os.path.join(self.dir, f"{self.worker}.{time.time_ns() // 1_000_000}"
                                      ".pt.trace.json")
        prof.export_chrome_trace(path)
        self.trace = path

    @hookimpl
    def distrun_on_step_end(self, run, step):
        if self.prof is None:
            return
        self.prof.step()
        self.steps += 1
        if self.steps >= self.total:  # the cycle is over: step() has written the trace
            self.finish(run)

    def finish(self, run: Any) -> None:
        """Stop (a fit that ended while recording writes what it has) and say what was seen."""
        prof, self.prof = self.prof, None
        if prof is None:
            return
        prof.stop()
        if run.pm.is_registered(self):
            run.pm.unregister(self)  # the rest of the fit runs without this step hook
        if not run.is_global_zero:
            return
        recorded = max(0, self.steps - self.wait - self.warmup)
        if self.trace is None or recorded == 0:
            run.log.warning(
                "warning: the profiler traced nothing: the fit ended after %d step(s), before "
                "the first recorded one (--profile-wait %d + --profile-warmup %d)", self.steps,
                self.wait, self.warmup)
            return
        line = (f"Profiler: steps {self.first}-{self.first + recorded - 1} traced on every "
                f"rank into {self.dir}")
        ops = top_ops(prof.key_averages(), self.top, self.device) if self.top else []
        if ops:
            kind = "device" if self.device else "CPU"
            line += f"; top ops by self {kind} time on rank 0: " + ", ".join(
                f"{name} {ms:.2f} ms ({share:.0%})" for name, ms, share in ops)
        run.log.info(line)
