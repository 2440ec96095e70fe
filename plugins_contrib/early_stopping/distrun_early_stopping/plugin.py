"""Entry point of distrun-early-stopping (torch-free import).

Every ``distrun_log_metrics`` call that carries ``--early-stop-monitor`` is one check. The
values are already reduced over ranks, so every rank makes the same decision; each calls
``run.request_stop()`` and the ranks stop together after the same step. Rank 0 says why in
one line. The best value and the count of checks without improvement ride in checkpoints,
so a resumed run goes on counting.
"""

from __future__ import annotations

from distrun.plugin import StashKey, hookimpl
from distrun_early_stopping.callback import judge
from distrun_early_stopping.options import EarlyStoppingOptions
from distrun_early_stopping.rule import EarlyStopping

DISTRUN_PLUGIN_API = 1  # the distrun.plugin API this plugin is written for

__all__ = ["EARLY_STOPPING", "STATE_NAME"]

#: this run's rule (every rank), when ``--early-stop-monitor`` is set
EARLY_STOPPING: StashKey[EarlyStopping] = StashKey("early_stopping")
#: its name in checkpoints
STATE_NAME = "early_stopping"
_WARNED: StashKey[bool] = StashKey("early_stopping.warned")


@hookimpl
def distrun_register_options(register):
    register(EarlyStoppingOptions)


def _rule(run) -> EarlyStopping | None:
    """This run's rule, made on first use; None when early stopping is off or the run is not
    fitting (a validate/test stage of the same session logs metrics it must not judge)."""
    if getattr(run, "stage", "fit") != "fit":
        return None
    rule = run.stash.get(EARLY_STOPPING)
    if rule is not None:
        return rule
    cfg = EarlyStoppingOptions.of(run.config)
    monitor = cfg.early_stop_monitor
    if not monitor:
        return None
    rule = EarlyStopping(
        monitor=monitor, mode=cfg.early_stop_mode, patience=cfg.early_stop_patience,
        min_delta=cfg.early_stop_min_delta, check_finite=cfg.early_stop_check_finite,
        stopping_threshold=cfg.early_stop_stopping_threshold,
        divergence_threshold=cfg.early_stop_divergence_threshold)
    run.stash[EARLY_STOPPING] = rule
    return rule


@hookimpl
def distrun_on_fit_start(run):
    rule = _rule(run)
    if rule is not None:  # another fit of the same session: judge afresh from the kept best
        rule.reason = rule.stopped_at = None


@hookimpl
def distrun_log_metrics(run, step, metrics):
    rule = _rule(run)
    if rule is None:
        return
    judge(rule, run, step, metrics)


def _warn_if_missing(run, when: str) -> None:
    """Once per run, on rank 0: the monitored metric was not among those logged so far."""
    rule = run.stash.get(EARLY_STOPPING)
    if rule is None or rule.monitor in rule.seen or not rule.seen or run.stash.get(_WARNED):
        return
    run.stash[_WARNED] = True
    if run.is_global_zero:
        run.log.warning(
            "warning: --early-stop-monitor %s: no metric of that name was logged by %s "
            "(logged: %s); early stopping waits for it", rule.monitor, when,
            ", ".join(sorted(rule.seen)))


@hookimpl
def distrun_on_validation_end(run, step, metrics):
    rule = _rule(run)
    if rule is not None:
        rule.seen.update(metrics)
        _warn_if_missing(run, f"the validation at step {step}")


@hookimpl
def distrun_on_epoch_end(run, epoch):
    _warn_if_missing(run, f"the end of epoch {epoch}")


@hookimpl
def distrun_on_fit_end(run):
    _warn_if_missing(run, "the end of the fit")


@hookimpl
def distrun_state_dict(run):
    rule = run.stash.get(EARLY_STOPPING) or _rule(run)
    if rule is None:
        return None
    return {STATE_NAME: rule.state_dict()}


@hookimpl
def distrun_load_state_dict(run, state):
    rule = _rule(run)
    if rule is None or STATE_NAME not in state:
        return
    saved = dict(state[STATE_NAME])
    if not rule.load_state_dict(saved) and run.is_global_zero:
        run.log.info("Early stopping: the checkpoint followed %s (%s); starting afresh for %s "
                     "(%s)", saved.get("monitor"), saved.get("mode"), rule.monitor, rule.mode)
