"""``--compile``: torch.compile of what runs the steps, and the time it takes, said once.

torch.compile compiles lazily: the first training step (or the sanity pass's first
validation batch) waits while dynamo traces and inductor builds kernels, seconds to minutes
on a CPU. The loop must not read that as a slow step. :class:`CompileClock` adds up the
seconds this process spends compiling (dynamo's compile start/end callbacks, which also fire
for a backward compiled lazily and for each recompilation), and:

- rank 0 says when the first compilation starts, and after the first training step how long
  compiling took and whether inductor's cache was warm (graphs loaded) or cold (built);
- a log window's ``samples_per_sec`` leaves out the steps that compiled (whole: also their
  wait for another rank's compile), and the row carries those seconds since the previous row
  as ``compile_s`` (a ``metrics.csv`` column);
- the progress bar reads the clock (:data:`~distrun._spec.keys.COMPILE_TIME`) to leave it
  out of its rate and ETA.

The callbacks are torch's ``torch._dynamo.callback.callback_handler`` (torch >= 2.4; no public
equivalent in 2.13). Without it the run compiles as before and the line says the time is not
measured.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from distrun._spec.keys import COMPILE_TIME
from distrun._spec.markers import hookimpl

__all__ = ["CompileClock", "FirstStep", "cache_dir", "say_compiled", "start_clock"]

log = logging.getLogger("distrun")


def _handler() -> Any:
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:  # pragma: no cover (torch < 2.4)
        return None
    return callback_handler


def _cache_counts() -> tuple[int, int]:
    """Inductor's FX graph cache (hits, misses) in this process so far."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover
        return 0, 0
    return (int(counters["inductor"]["fxgraph_cache_hit"]),
            int(counters["inductor"]["fxgraph_cache_miss"]))


def _graphs(n: int) -> str:
    return f"{n} graph{'s' * (n != 1)}"


def cache_dir() -> str:
    """Where inductor keeps its compile cache (``TORCHINDUCTOR_CACHE_DIR``, else torch's
    default: /tmp/torchinductor_USER)."""
    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if folder:
        return os.path.abspath(folder)
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        return str(default_cache_dir())
    except ImportError:  # pragma: no cover
        return "torch's default cache folder"


class CompileClock:
    """Seconds this process spent in torch.compile, from dynamo's compile callbacks."""

    def __init__(self, announce: bool) -> None:
        #: compile seconds so far (every compilation: training, evaluation, recompiles)
        self.seconds = 0.0
        #: ``seconds`` at the last metrics row (what the next row reports as ``compile_s``)
        self.logged = 0.0
        #: seconds of training steps that compiled beyond this rank's own compiling: the
        #: wait for another rank's (a pipeline's next stage, an all-reduce)
        self.waited = 0.0
        self._mark: float | None = None
        self._mark_seconds = 0.0
        #: compilations started (a nested one counts once: torch's handler pairs them)
        self.count = 0
        #: the line after the first compiled step has been said (or is not to be)
        self.reported = False
        self._announce = announce
        self._lock = threading.Lock()
        self._began: float | None = None
        self._cache_base = _cache_counts()
        self._handler = _handler()
        if self._handler is not None:
            self._handler.register_start_callback(self._start)
            self._handler.register_end_callback(self._end)

    @property
    def measured(self) -> bool:
        return self._handler is not None

    def _start(self, *args: Any) -> None:
        with self._lock:
            self._began = time.perf_counter()
            self.count += 1
            first = self.count == 1
        if first and self._announce:
            log.info("torch.compile: compiling the model; the first steps wait for it "
                     "(inductor cache %s)", cache_dir())

    def _end(self, *args: Any) -> None:
        with self._lock:
            if self._began is not None:
                self.seconds += time.perf_counter() - self._began
                self._began = None

    @property
    def excluded(self) -> float:
        """Seconds kept out of rates: compiling, and steps' waits for other ranks' compiles."""
        return self.seconds + self.waited

    def mark_step(self) -> None:
        """A training step starts now (the fit's first, or the next after a validation)."""
        self._mark, self._mark_seconds = time.perf_counter(), self.seconds

    def step_ended(self) -> None:
        """A step that compiled is no ordinary step: all of it is kept out of the rate, also
        what it waited for another rank's compile (whose clock this rank cannot read)."""
        now = time.perf_counter()
        if self._mark is not None and self.seconds > self._mark_seconds:
            compiled = self.seconds - self._mark_seconds
            self.waited += max(0.0, now - self._mark - compiled)
        self._mark, self._mark_seconds = now, self.seconds

    def take_unlogged(self) -> float:
        """The seconds kept out since the last metrics row (and mark them logged)."""
        with self._lock:
            excluded = self.excluded
            unlogged, self.logged = excluded - self.logged, excluded
        return unlogged

    def cache_words(self) -> str:
        """``inductor cache warm (4 graphs loaded)``, ``cold (4 graphs built)`` or partly."""
        hits, misses = _cache_counts()
        hits -= self._cache_base[0]
        misses -= self._cache_base[1]
        if hits and not misses:
            return f"inductor cache warm ({_graphs(hits)} loaded)"
        if misses and not hits:
            return f"inductor cache cold ({_graphs(misses)} built)"
        if hits or misses:
            return f"inductor cache partly warm ({_graphs(hits)} loaded, {misses} built)"
        return "no inductor graph"

    def close(self) -> None:
        """Stop listening to dynamo (the run's session ends)."""
        if self._handler is not None:
            for remove, fn in ((self._handler.remove_start_callback, self._start),
                               (self._handler.remove_end_callback, self._end)):
                try:
                    remove(fn)
                except ValueError:
                    pass
            self._handler = None


def start_clock(run: Any) -> CompileClock:
    """The run's compile clock (made once a session, before the model is compiled)."""
    clock = run.stash.get(COMPILE_TIME)
    if clock is None:
        clock = run.stash[COMPILE_TIME] = CompileClock(announce=run.is_global_zero)
    return clock


def say_compiled(run: Any, when: str) -> None:
    """Rank 0's one line of how long compiling took, once, after ``when`` (the first training
    step, or an evaluation stage)."""
    clock = run.stash.get(COMPILE_TIME)
    if clock is None or clock.reported or not clock.count:
        return
    clock.reported = True
    if not run.is_global_zero:
        return
    if not clock.measured:  # pragma: no cover (torch < 2.4)
        log.info("torch.compile: compiled by the end of %s (this torch does not say how long)",
                 when)
        return
    log.info("torch.compile: %.1f s compiling by the end of %s, %s at %s; left out of "
             "samples/s, logged as compile_s", clock.seconds, when, clock.cache_words(),
             cache_dir())


class FirstStep:
    """Registered for a compiled fit (``run.add_hooks``): times the steps that compile, and
    says the compile line after the first (a pluggy call per step, ~3 us, compiled runs only)."""

    @hookimpl
    def distrun_on_step_end(self, run: Any, step: int) -> None:
        clock = run.stash[COMPILE_TIME]
        clock.step_ended()
        if not clock.reported:
            say_compiled(run, "the first step")
