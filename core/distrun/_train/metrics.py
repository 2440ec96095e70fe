"""Values a task logs from its steps, accumulated per name and summed over ranks exactly.

A step logs with ``self.log(name, value)`` (a :class:`~distrun._train.task.Task` method),
``distrun.log(name, value)`` (any task), or by returning a dict: ``{"loss": loss, "acc":
acc}`` from ``training_step`` (the other keys are logged), or any dict from an evaluation
step. Where a value goes depends on the stage, as in Lightning:

- training: ``on_step`` (default) means averaged over the steps since the last log row and
  logged with ``loss`` every ``log_every_n_steps``; ``on_epoch`` means averaged over the epoch
  and logged at its end (``NAME_step`` and ``NAME_epoch`` when both are asked for);
- validation, test: averaged over the whole pass, weighted by each batch's real samples (the
  padding that evens out the ranks' batches counts zero), named ``val_NAME`` / ``test_NAME``.

A torchmetrics metric object may be logged instead of a number (``self.log("val_acc",
self.val_acc)``): its ``compute()`` is logged where an average would be, and it is reset
there (see :mod:`distrun._train.metric_objects`).

Every reduction is a sum over ranks of (weighted sum, weight) pairs, so a mean over ranks is
the mean over all samples, whatever each rank saw. Ranks must log the same names (the pairs
are packed by name in order of first use; a rank that logs a name the others never log makes
the packed sizes differ, which the loop reports).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from distrun._spec.errors import UsageError
from distrun._train.metric_objects import MetricObjects, forward_value, is_metric

__all__ = ["REDUCTIONS", "Accumulator", "LogTarget", "log", "logging_to"]

#: how values of one name combine over steps and ranks
REDUCTIONS = ("mean", "sum")


class Accumulator:
    """Per name, the weighted sum and the weight since the last :meth:`pack`.

    Names are kept in order of first use across packs, so every pack of a fit has the same
    layout on every rank (a rank that logged nothing for a name packs zeros for it).
    """

    def __init__(self) -> None:
        self.reductions: dict[str, str] = {}  # name -> "mean" | "sum", in order of first use
        self._sums: dict[str, torch.Tensor] = {}
        self._weights: dict[str, float] = {}
        #: the metric objects logged since the last :meth:`reduce`
        self.objects = MetricObjects()

    def __bool__(self) -> bool:
        return bool(self.reductions) or bool(self.objects)

    def add(self, name: str, value: Any, weight: float = 1.0, reduce: str = "mean") -> None:
        if not isinstance(name, str) or not name:
            raise UsageError(f"log(name, value): the name must be a non-empty string, not "
                             f"{name!r}")
        if name in self.objects.entries:
            raise UsageError(f"log({name!r}, value): {name!r} was logged as a metric object "
                             "before; log one kind of value per name")
        known = self.reductions.setdefault(name, reduce)
        if known != reduce:
            raise UsageError(f"log({name!r}, ..., reduce={reduce!r}): this name was logged "
                             f"with reduce={known!r} before; use one reduction per name")
        t = _scalar(name, value)
        if reduce == "sum":
            weight = 1.0
        prev = self._sums.get(name)
        t = t * weight if weight != 1.0 else t
        self._sums[name] = t if prev is None else prev + t
        self._weights[name] = self._weights.get(name, 0.0) + weight

    def pack(self, device: torch.device) -> torch.Tensor:
        """``[sum, weight]`` per known name as float64 on ``device``, and start afresh."""
        parts: list[torch.Tensor] = []
        for name in self.reductions:
            total = self._sums.get(name)
            parts.append(total.reshape(1).to(device) if total is not None
                         else torch.zeros(1, dtype=torch.float64, device=device))
            parts.append(torch.tensor([self._weights.get(name, 0.0)], dtype=torch.float64,
                                      device=device))
        self._sums, self._weights = {}, {}
        if not parts:
            return torch.zeros(0, dtype=torch.float64, device=device)
        return torch.cat(parts)

    def reduce(self, strategy: Any, prefix: str = "") -> dict[str, float]:
        """Pack, sum over the ranks (one all-reduce through ``strategy``) and unpack: the
        values since the last pack, the same on every rank; then the logged metric objects'
        ``compute()`` (each gathers over the ranks itself), and their reset. Every rank must
        call it."""
        out: dict[str, float] = {}
        if self.reductions:
            packed = self.pack(strategy.device)
            strategy.all_reduce(packed, "sum")
            out = self.unpack(packed, prefix=prefix)
        out.update(self.objects.compute(prefix=prefix))
        return out

    def unpack(self, summed: Any, prefix: str = "") -> dict[str, float]:
        """The values of a packed (and summed over ranks) tensor, by name; names nobody logged
        since the last pack are left out."""
        values = summed.tolist() if isinstance(summed, torch.Tensor) else list(summed)
        out: dict[str, float] = {}
        for i, (name, reduce) in enumerate(self.reductions.items()):
            total, weight = values[2 * i], values[2 * i + 1]
            if weight == 0:
                continue
            key = name if not prefix or name.startswith(prefix) else prefix + name
            out[key] = total if reduce == "sum" else total / weight
        return out


def _scalar(name: str, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise UsageError(f"log({name!r}, value): the value has shape {tuple(value.shape)}; "
                             "log one number (e.g. value.mean())")
        return value.detach().reshape(()).to(torch.float64)
    try:
        return torch.tensor(float(value), dtype=torch.float64)
    except (TypeError, ValueError):
        raise UsageError(f"log({name!r}, value): {type(value).__name__} is not a number; log a "
                         "float, a one-element tensor or a torchmetrics metric") from None


class LogTarget:
    """Where the step running now logs: the stage's accumulators and defaults."""

    def __init__(self, stage: str, step: Accumulator | None, epoch: Accumulator) -> None:
        self.stage = stage
        self.step = step  # None outside training: evaluation logs per pass only
        self.epoch = epoch
        #: the weight of the values logged now (evaluation: the batch's real samples)
        self.weight = 1.0

    def add(self, name: str, value: Any, on_step: bool | None, on_epoch: bool | None,
            reduce: str) -> None:
        if reduce not in REDUCTIONS:
            raise UsageError(f"log({name!r}, ..., reduce={reduce!r}): reduce must be one of "
                             f"{', '.join(REDUCTIONS)}")
        training = self.step is not None
        if on_step is None:
            on_step = training
        if on_epoch is None:
            on_epoch = not training
        if is_metric(value):
            self._add_metric(name, value, on_step, on_epoch)
            return
        if not training:  # one value per pass
            self.epoch.add(name, value, self.weight, reduce)
            return
        if on_step and on_epoch:
            self.step.add(name + "_step", value, self.weight, reduce)  # type: ignore[union-attr]
            self.epoch.add(name + "_epoch", value, self.weight, reduce)
        elif on_epoch:
            self.epoch.add(name, value, self.weight, reduce)
        elif on_step:
            self.step.add(name, value, self.weight, reduce)  # type: ignore[union-attr]

    def _add_metric(self, name: str, metric: Any, on_step: bool, on_epoch: bool) -> None:
        """A metric object: computed (and reset) at the end of the pass or the epoch; in
        training ``on_step`` logs the value of the step's batch."""
        if self.step is None:
            self._object(self.epoch, name, metric, True)
            return
        if on_step:
            value = forward_value(metric)
            if value is not None:  # (none after update() alone: Lightning logs none either)
                self.step.add(name + "_step" if on_epoch else name, value, self.weight, "mean")
        if on_epoch:
            self._object(self.epoch, name + "_epoch" if on_step else name, metric, True)
        else:  # reset when the epoch ends, as Lightning resets what was logged
            self._object(self.epoch, name, metric, False)

    @staticmethod
    def _object(acc: Accumulator, name: str, metric: Any, computed: bool) -> None:
        if name in acc.reductions:
            raise UsageError(f"log({name!r}, metric): {name!r} was logged as a number before; "
                             "log one kind of value per name")
        acc.objects.add(name, metric, computed)

    def add_many(self, values: Mapping[str, Any], skip: str = "") -> None:
        """The keys of a dict a step returned (``skip``: the training loss)."""
        for name, value in values.items():
            if name != skip:
                self.add(name, value, None, None, "mean")


#: the targets of the steps running now (innermost last)
_TARGETS: list[LogTarget] = []


@contextmanager
def logging_to(target: LogTarget) -> Iterator[LogTarget]:
    """Route ``log()`` calls to ``target`` while the block runs."""
    _TARGETS.append(target)
    try:
        yield target
    finally:
        _TARGETS.remove(target)


def log(name: str, value: Any, *, on_step: bool | None = None, on_epoch: bool | None = None,
        reduce: str = "mean") -> None:
    """Log ``value`` (a number, a one-element tensor or a torchmetrics metric object) as
    ``name`` from inside a step.

    ``on_step``/``on_epoch`` default to Lightning's: per log row in training, per pass in
    validation and test. ``reduce`` is ``"mean"`` (over steps, samples and ranks) or
    ``"sum"``; a metric object reduces as it defines (its ``compute()``). Every rank must log
    the same names.
    """
    if not _TARGETS:
        raise UsageError(f"log({name!r}, ...) was called outside a step; log from "
                         "training_step, validation_step or test_step while distrun runs them")
    _TARGETS[-1].add(name, value, on_step, on_epoch, reduce)
