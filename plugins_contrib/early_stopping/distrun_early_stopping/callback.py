"""``EarlyStopping`` as a callback object (``Trainer(callbacks=[EarlyStopping("val_loss")])``).

The same rule as the flag form (:mod:`.rule`), registered as a plugin of its own: several may
run at once (each with its monitor), and each one's best value and count ride in checkpoints
under its :attr:`~EarlyStopping.state_key`. Torch-free.
"""

from __future__ import annotations

from typing import Any

from distrun.plugin import hookimpl
from distrun_early_stopping import rule

__all__ = ["EarlyStopping", "judge"]


def judge(stopper: rule.EarlyStopping, run: Any, step: int, metrics: Any) -> None:
    """One check of ``stopper`` on the reduced ``metrics`` (the same on every rank); ask the
    ranks to stop when it says so, rank 0 saying why."""
    stopper.seen.update(metrics)
    value = metrics.get(stopper.monitor)
    if value is None or stopper.stopped_at is not None:
        return
    reason = stopper.check(float(value), step)
    if reason is None:
        return
    run.request_stop()
    if run.is_global_zero:
        run.log.info("Early stopping at step %d: %s (%s); stopping the fit",
                     step, reason, stopper.describe_best())


class EarlyStopping(rule.EarlyStopping):
    """Stop the fit when ``monitor`` stops improving (Lightning's ``EarlyStopping``): the
    arguments of :class:`distrun_early_stopping.rule.EarlyStopping`. Checked at every logged
    value of ``monitor`` (each validation for ``val_*``)."""

    # a plugin is itself, not its values: two equal rules are two callbacks
    __eq__ = object.__eq__
    __hash__ = object.__hash__

    @property
    def state_key(self) -> str:
        return f"early_stopping[monitor={self.monitor},mode={self.mode}]"

    @hookimpl
    def distrun_on_fit_start(self, run: Any) -> None:
        self.reason = self.stopped_at = None  # another fit: judge afresh from the kept best

    @hookimpl
    def distrun_log_metrics(self, run: Any, step: int, metrics: Any) -> None:
        if getattr(run, "stage", "fit") == "fit":
            judge(self, run, step, metrics)

    @hookimpl
    def distrun_state_dict(self, run: Any) -> dict[str, Any]:
        return {self.state_key: self.state_dict()}

    @hookimpl
    def distrun_load_state_dict(self, run: Any, state: Any) -> None:
        if self.state_key in state:
            self.load_state_dict(dict(state[self.state_key]))
