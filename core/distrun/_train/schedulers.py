"""Learning-rate schedulers: what a task returns, when each one steps, and their state.

``Task.configure_scheduler(optimizer)`` (or the ``"lr_scheduler"`` of a dict that
``configure_optimizer`` returns, as Lightning's ``configure_optimizers`` does) may give:

- a scheduler: stepped after every optimizer step (distrun's default; Lightning's is
  ``"epoch"``: say ``{"scheduler": s, "interval": "epoch"}`` to port such a task as it is);
- a dict ``{"scheduler": s, "interval": "step" | "epoch", "frequency": N, "monitor":
  "val_loss", "strict": True, "name": "..."}``;
- a list of either.

A scheduler with a ``monitor`` (``ReduceLROnPlateau`` needs one) is stepped with the latest
value of that metric, reduced over ranks (so every rank steps it identically). Per-step ones
step after each optimizer step; per-epoch ones after the epoch's validation. Their states go
into every checkpoint (``schedulers``, one per scheduler, in order).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from distrun._spec.errors import UsageError

__all__ = ["Scheduled", "load_scheduler_states", "normalize_schedulers", "scheduler_states",
           "step_schedulers"]

log = logging.getLogger("distrun")

_KEYS = frozenset({"scheduler", "interval", "frequency", "monitor", "strict", "name"})


@dataclass
class Scheduled:
    """One scheduler and when it steps."""

    scheduler: Any
    interval: str = "step"
    frequency: int = 1
    monitor: str | None = None
    strict: bool = True
    name: str = ""

    @property
    def plateau(self) -> bool:
        """Steps with a metric value (``ReduceLROnPlateau`` and the like)."""
        return self.monitor is not None


def _one(item: Any, index: int) -> Scheduled:
    if isinstance(item, Scheduled):
        return item
    if isinstance(item, Mapping):
        unknown = sorted(set(item) - _KEYS)
        if unknown or "scheduler" not in item:
            what = f"unknown keys {', '.join(unknown)}" if unknown else "no 'scheduler' key"
            rest = ", ".join(sorted(_KEYS - {"scheduler"}))
            raise UsageError(f"scheduler config {index}: {what}; a scheduler dict has "
                             f"'scheduler' and any of {rest}")
        s = Scheduled(item["scheduler"], str(item.get("interval", "step")),
                      int(item.get("frequency", 1)), item.get("monitor"),
                      bool(item.get("strict", True)), str(item.get("name", "")))
    else:
        s = Scheduled(item)
    if s.interval not in ("step", "epoch"):
        raise UsageError(f"scheduler {index}: interval {s.interval!r} must be 'step' or 'epoch'")
    if s.frequency < 1:
        raise UsageError(f"scheduler {index}: frequency must be 1 or more, not {s.frequency}")
    if not callable(getattr(s.scheduler, "step", None)):
        raise UsageError(f"scheduler {index}: {type(s.scheduler).__name__} has no step(); "
                         "return a torch.optim.lr_scheduler object")
    needs_metric = type(s.scheduler).__name__ == "ReduceLROnPlateau"
    if needs_metric and s.monitor is None:
        raise UsageError(f"scheduler {index}: ReduceLROnPlateau needs a metric to watch: return "
                         "{'scheduler': s, 'monitor': 'val_loss', 'interval': 'epoch'}")
    if not s.name:
        s.name = f"lr-{type(s.scheduler).__name__}" + (f"-{index}" if index else "")
    return s


def normalize_schedulers(value: Any) -> list[Scheduled]:
    """The task's scheduler return value as a list of :class:`Scheduled` (empty for None)."""
    if value is None:
        return []
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    return [_one(item, i) for i, item in enumerate(items)]


def step_schedulers(schedulers: list[Scheduled], interval: str, count: int,
                    metrics: Mapping[str, float]) -> None:
    """Step the ``interval`` schedulers due at ``count`` (steps or epochs done, from 1)."""
    for s in schedulers:
        if s.interval != interval or count % s.frequency:
            continue
        if not s.plateau:
            s.scheduler.step()
            continue
        value = metrics.get(s.monitor)  # type: ignore[arg-type]
        if value is None:
            if s.strict:
                raise UsageError(
                    f"the scheduler {s.name} monitors {s.monitor!r}, which no step has logged "
                    f"(logged: {', '.join(sorted(metrics)) or 'nothing yet'}); log it, pick one "
                    "of those, or set 'strict': False to skip such steps")
            continue
        if not math.isfinite(value):
            log.warning("the scheduler %s got %s = %s; stepped with it", s.name, s.monitor, value)
        s.scheduler.step(value)


def scheduler_states(schedulers: list[Scheduled]) -> list[Any]:
    """The ``state_dict`` of each of the run's schedulers that has one, in order."""
    return [s.scheduler.state_dict() for s in schedulers if hasattr(s.scheduler, "state_dict")]


def load_scheduler_states(schedulers: list[Scheduled], states: list[Any]) -> None:
    """Give each stateful scheduler back its state from :func:`scheduler_states`; a count
    that differs is a one-line :class:`UsageError`."""
    stateful = [s for s in schedulers if hasattr(s.scheduler, "load_state_dict")]
    if len(states) != len(stateful):
        raise UsageError(f"the checkpoint holds {len(states)} scheduler state(s) but the task has "
                         f"{len(stateful)} scheduler(s); resume with the same schedulers, or "
                         "--resume never")
    for s, state in zip(stateful, states):
        s.scheduler.load_state_dict(state)
