"""The early-stopping rule: plain Python (no torch), fed the same values on every rank."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MODES", "EarlyStopping"]

#: ``--early-stop-mode``: which direction is an improvement
MODES = ("min", "max")


@dataclass
class EarlyStopping:
    """Follows one monitored metric; :meth:`check` takes each new value and says when to stop.

    A check improves when the value beats the best so far by more than ``min_delta`` (lower
    for ``min``, higher for ``max``); ``patience`` checks in a row without improvement stop
    the fit. A non-finite value stops at once (``check_finite``), and so do the optional
    thresholds: ``stopping_threshold`` (good enough) and ``divergence_threshold`` (hopeless).
    """

    monitor: str
    mode: str = "min"
    patience: int = 3
    min_delta: float = 0.0
    check_finite: bool = True
    stopping_threshold: float | None = None
    divergence_threshold: float | None = None
    #: the best value so far and the step it was logged at (None before the first check)
    best: float | None = None
    best_step: int | None = None
    #: checks since the last improvement
    wait: int = 0
    #: the step of the last check: a value logged again at that step is not a new check
    last_step: int | None = None
    #: why the fit was asked to stop, and at which step (not saved in checkpoints)
    reason: str | None = None
    stopped_at: int | None = None
    #: metric names logged so far (for the warning about a monitor that never shows up)
    seen: set[str] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {self.mode!r}")

    def better(self, value: float, than: float, by: float = 0.0) -> bool:
        """``value`` beats ``than`` by more than ``by`` in this rule's direction."""
        return value < than - by if self.mode == "min" else value > than + by

    def check(self, value: float, step: int) -> str | None:
        """Take the value logged at ``step``; return why the fit should stop, or None.

        One check per step: the same metric logged again at that step (a second validation
        pass at the same step) changes nothing.
        """
        if step == self.last_step:
            return None
        self.last_step = step
        if math.isfinite(value) and (self.best is None or
                                     self.better(value, self.best, self.min_delta)):
            self.best, self.best_step, self.wait = value, step, 0
        else:
            self.wait += 1
        reason = None
        if self.check_finite and not math.isfinite(value):
            reason = f"{self.monitor} is {value}, not a finite number"
        elif self.stopping_threshold is not None and \
                self.better(value, self.stopping_threshold):
            reason = (f"{self.monitor} = {value:.6g} reached the stopping threshold "
                      f"{self.stopping_threshold:g}")
        elif self.divergence_threshold is not None and \
                self.better(self.divergence_threshold, value):
            reason = (f"{self.monitor} = {value:.6g} is past the divergence threshold "
                      f"{self.divergence_threshold:g}")
        elif self.wait > 0 and self.wait >= self.patience:
            by = f" by more than {self.min_delta:g}" if self.min_delta else ""
            reason = (f"{self.monitor} did not improve{by} in {self.wait} "
                      f"check{'s' if self.wait != 1 else ''}")
        if reason is not None:
            self.reason, self.stopped_at = reason, step
        return reason

    def describe_best(self) -> str:
        if self.best is None:
            return "no finite value yet"
        return f"best {self.monitor} {self.best:.6g} at step {self.best_step}"

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to go on counting (JSON values)."""
        return {"monitor": self.monitor, "mode": self.mode, "best": self.best,
                "best_step": self.best_step, "wait": self.wait}

    def load_state_dict(self, state: dict[str, Any]) -> bool:
        """Take back a saved state; False (nothing taken) when it followed another metric or
        direction, whose best value means nothing for this one."""
        if state.get("monitor") != self.monitor or state.get("mode") != self.mode:
            return False
        best = state.get("best")
        self.best = None if best is None else float(best)
        step = state.get("best_step")
        self.best_step = None if step is None else int(step)
        self.wait = int(state.get("wait", 0))
        return True
