"""Metric objects (torchmetrics') logged from steps: computed over every rank, then reset.

``self.log("val_acc", self.val_acc)``, where ``self.val_acc`` is a torchmetrics ``Metric``
the step updates (``self.val_acc.update(preds, y)`` or ``self.val_acc(preds, y)``), does what
it does in Lightning:

- validation, test: at the end of the pass the loop calls ``compute()`` (torchmetrics gathers
  every rank's state there), logs the value as ``val_acc`` and calls ``reset()``;
- training: ``on_step`` logs the value of the step's batch (what ``metric(preds, y)``
  returned; nothing when the step called ``update`` only), ``on_epoch`` the ``compute()`` at
  the epoch's end; either way the metric is reset when the epoch ends.

The evaluation's filler batches (a rank with fewer samples runs its first batch again so
that every rank runs the same number of forwards) must not reach a metric's state. The loop
runs a filler batch's step inside :func:`metrics_untouched`, which puts back the state of every
metric object the task holds as it was before the step: the forward runs (a sharded model's
collectives need it), its updates leave no trace, and the task does nothing for it.

The core does not import torchmetrics: a metric object is recognized by its methods
(``update``, ``compute``, ``reset``) and torchmetrics' registry of its states (``_defaults``:
the names ``add_state`` registered, whose values are tensors or lists of tensors).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from distrun._spec.errors import UsageError

__all__ = ["MetricObjects", "forward_value", "is_metric", "metrics_of", "metrics_untouched",
           "place_metrics"]


def is_metric(value: Any) -> bool:
    """A torchmetrics-like metric object: ``update``/``compute``/``reset`` and a registry of
    its states."""
    return (callable(getattr(value, "update", None)) and callable(getattr(value, "compute", None))
            and callable(getattr(value, "reset", None))
            and isinstance(getattr(value, "_defaults", None), dict))


def forward_value(metric: Any) -> Any:
    """The value the metric's last ``metric(...)`` call returned (None after ``update`` only,
    or after a reset)."""
    return getattr(metric, "_forward_cache", None)


def metrics_of(task: Any) -> list[Any]:
    """The metric objects a task holds: its attributes, the modules inside them (a
    ``MetricCollection``'s metrics, a metric wrapper's) and the items of its dicts, lists and
    tuples; each once."""
    found: dict[int, Any] = {}

    def visit(value: Any) -> None:
        if isinstance(value, torch.nn.Module):
            for module in value.modules():
                if is_metric(module):
                    found.setdefault(id(module), module)
        elif is_metric(value):
            found.setdefault(id(value), value)

    for value in list(getattr(task, "__dict__", {}).values()):
        if isinstance(value, dict):
            for item in list(value.values()):
                visit(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)
        else:
            visit(value)
    return list(found.values())


def _state_of(metric: Any) -> dict[str, Any]:
    """A copy of what an update changes: the registered states and the update bookkeeping."""
    saved: dict[str, Any] = {}
    for name in metric._defaults:
        value = getattr(metric, name)
        # an update may change a state tensor in place (``self.tp += tp``): keep a copy; a
        # list state is only appended to: a new list of the same tensors is enough
        saved[name] = value.clone() if isinstance(value, torch.Tensor) else list(value)
    for name in ("_update_count", "_computed", "_forward_cache"):
        if hasattr(metric, name):
            saved[name] = getattr(metric, name)
    return saved


def _restore(metric: Any, saved: dict[str, Any]) -> None:
    for name, value in saved.items():
        setattr(metric, name, value)


@contextmanager
def metrics_untouched(task: Any) -> Iterator[None]:
    """Run a step whose updates must not count (a filler batch): every metric object of
    ``task`` ends the block in the state it started it in."""
    saved = [(m, _state_of(m)) for m in metrics_of(task)]
    try:
        yield
    finally:
        for metric, state in saved:
            _restore(metric, state)


def place_metrics(task: Any, device: torch.device) -> None:
    """Move the task's metric objects to the run's device (Lightning moves them with the
    module; a distrun task is not a module), so a step's ``update`` gets tensors on one
    device and their gather at ``compute()`` runs on the backend's device."""
    if device.type == "cpu":
        return
    for metric in metrics_of(task):
        if isinstance(metric, torch.nn.Module):
            metric.to(device)


class MetricObjects:
    """The metric objects logged since the last :meth:`compute`, by logged name, in order of
    first use (every rank computes them in that order: each ``compute()`` is a collective)."""

    def __init__(self) -> None:
        #: name -> (metric, whether its compute() is logged; False: reset only)
        self.entries: dict[str, tuple[Any, bool]] = {}

    def __bool__(self) -> bool:
        return bool(self.entries)

    def add(self, name: str, metric: Any, computed: bool = True) -> None:
        known = self.entries.get(name)
        if known is not None and known[0] is not metric:
            raise UsageError(f"log({name!r}, metric): another metric object was logged as "
                             f"{name!r} before; log each metric object under its own name")
        self.entries[name] = (metric, computed or (known is not None and known[1]))

    def compute(self, prefix: str = "") -> dict[str, float]:
        """Each logged metric's ``compute()`` (gathered over every rank by the metric), by
        name, then its ``reset()``. Every rank must call it, having logged the same names."""
        out: dict[str, float] = {}
        entries, self.entries = self.entries, {}
        for name, (metric, computed) in entries.items():
            if computed:
                key = name if not prefix or name.startswith(prefix) else prefix + name
                out[key] = _number(name, metric, metric.compute())
        for metric, _ in entries.values():
            metric.reset()
        return out


def _number(name: str, metric: Any, value: Any) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    shape = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else \
        type(value).__name__
    raise UsageError(f"log({name!r}, metric): {type(metric).__name__}.compute() gave a "
                     f"{shape}, not one number; log a metric that computes one (e.g. "
                     "average='micro' or 'macro' rather than None), or log its parts by name")
