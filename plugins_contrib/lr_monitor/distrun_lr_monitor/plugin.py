"""Entry point of distrun-lr-monitor: every param group's learning rate as metrics.

Adds ``lr-<group>`` (and, with ``--lr-monitor-momentum``, ``momentum-<group>``) to the
training rows of ``distrun_log_metrics``, so every logger (``metrics.csv``, the console,
TensorBoard, ...) gets them, plus one row of its own at the end of an epoch that would
otherwise have none. ``<group>`` is the group's ``"name"`` entry, else ``pg<index>``.

How the values join the row: a ``wrapper=True`` implementation of ``distrun_log_metrics``
adds them to the ``metrics`` dict before ``yield``. Pluggy passes the caller's objects to
every implementation as they are, and runs wrappers before all plain implementations
(``tryfirst`` ones included), so every logger sees the added values. The core builds a new
dict for each call, so adding to it changes nothing anywhere else.

Values are read when the step ends (``distrun_on_step_end``, registered only while the
monitor is on): the rate the optimizer holds after step N's scheduler step, i.e. the one
step N+1 uses, the same moment as the core's ``lr`` column. The reduced row of a log step
reaches the loggers a little later (it rides with the next vote), so reading the optimizer
then could show a later step's rate.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from distrun.plugin import StashKey, hookimpl
from distrun_lr_monitor.options import LrMonitorOptions

DISTRUN_PLUGIN_API = 1  # the distrun.plugin API this plugin is written for

__all__ = ["LR_MONITOR", "LrMonitor", "group_names"]


@hookimpl
def distrun_register_options(register):
    register(LrMonitorOptions)


def group_names(groups: list[dict[str, Any]]) -> list[str]:
    """``"name"`` of each param group, else ``pg<i>``; a repeated name gets ``-<i>``."""
    names: list[str] = []
    for i, group in enumerate(groups):
        name = str(group.get("name") or f"pg{i}")
        names.append(name if name not in names else f"{name}-{i}")
    return names


def _momentum(group: dict[str, Any]) -> Any:
    if "momentum" in group:
        return group["momentum"]
    betas = group.get("betas")
    return betas[0] if betas else None


def _snap(value: Any) -> Any:
    """A value as it is now: numbers are immutable, a tensor lr is copied (no host sync)."""
    return value.detach().clone() if hasattr(value, "detach") else value


class LrMonitor:
    """Registered for a fit (``run.add_hooks``) when the monitor is on."""

    def __init__(self, run: Any, momentum: bool) -> None:
        self.groups = run.optimizer.param_groups
        names = group_names(self.groups)
        self.lr_keys = [f"lr-{n}" for n in names]
        self.momentum_keys = [f"momentum-{n}" for n in names] if momentum else []
        self.every = int(run.config.log_every_n_steps or 0)
        #: values read at log steps, until their (reduced, later) row comes
        self.pending: dict[int, list[Any]] = {}
        #: the step and values of the last row that had them
        self.last: tuple[int, dict[str, float]] = (-1, {})

    def read(self) -> list[Any]:
        values = [_snap(g.get("lr")) for g in self.groups]
        if self.momentum_keys:
            values += [_snap(_momentum(g)) for g in self.groups]
        return values

    def metrics(self, values: list[Any]) -> dict[str, float]:
        keys = self.lr_keys + self.momentum_keys
        return {k: float(v) for k, v in zip(keys, values) if v is not None}

    @hookimpl
    def distrun_on_step_end(self, run, step):
        if self.every and step % self.every == 0:
            self.pending[step] = self.read()

    @hookimpl(wrapper=True)
    def distrun_log_metrics(self, run, step, metrics):
        # training rows only (the core's carry the loss); not a row that has them already
        if "loss" in metrics and self.lr_keys[0] not in metrics \
                and isinstance(metrics, MutableMapping):
            values = self.pending.pop(step, None)
            if values is None and step == run.progress.step:
                values = self.read()  # the fit's last, partial window: nothing stepped since
            for old in [s for s in self.pending if s < step]:
                del self.pending[old]  # rows that never came (a rank that joined early)
            if values is not None:
                extra = self.metrics(values)
                metrics.update(extra)
                run.metrics.update(extra)
                self.last = (step, extra)
        return (yield)

    @hookimpl
    def distrun_on_epoch_end(self, run, epoch):
        """A row of its own when the epoch's last step has no row with these values: the
        step was not a log step, or a per-epoch scheduler changed the rate since."""
        step = run.progress.step
        if step == 0:
            return
        log_step = bool(self.every) and step % self.every == 0
        if (run.done or run.progress.epoch >= run.config.max_epochs) and not log_step:
            return  # the fit's last, partial window is logged next, with the values
        extra = self.metrics(self.read())
        if self.last == (step, extra):
            return
        run.metrics.update(extra)
        run.hook.distrun_log_metrics(run=run, step=step, metrics={"epoch": float(epoch), **extra})
        self.last = (step, extra)


#: the fit's monitor (every rank), when on
LR_MONITOR: StashKey[LrMonitor] = StashKey("lr_monitor")


@hookimpl
def distrun_on_fit_start(run):
    cfg = LrMonitorOptions.of(run.config)
    if not cfg.lr_monitor or getattr(run, "stage", "fit") != "fit" \
            or run.optimizer is None or not run.optimizer.param_groups:
        return
    monitor = run.stash[LR_MONITOR] = LrMonitor(run, cfg.lr_monitor_momentum)
    run.add_hooks(monitor)
