"""Entry point of distrun-wandb: a Weights & Biases run per distrun run, written on rank 0.

Offline by default: the run is written under ``RUN_DIR/wandb`` and nothing contacts a server
(``wandb sync`` uploads it later). Importing this module imports neither torch nor wandb;
rank 0 imports wandb when the run starts, and only when the mode is not ``disabled``.
"""

from __future__ import annotations

from typing import Any

from distrun.plugin import StashKey, hookimpl
from distrun_wandb.options import WandbOptions

DISTRUN_PLUGIN_API = 1  # the distrun.plugin API this plugin is written for

#: the run's logger on rank 0 once opened; False where this plugin stays out of the run
_KEY: StashKey[Any] = StashKey("wandb")


@hookimpl
def distrun_register_options(register):
    register(WandbOptions)


def _logger(run: Any) -> Any:
    """The open logger, opening it on first use on rank 0; None where inactive."""
    logger = run.stash.get(_KEY)
    if logger is None:
        logger = False
        if run.is_global_zero:
            from distrun_wandb.logger import mode_of, open_logger

            if mode_of(WandbOptions.of(run.config)) != "disabled":
                logger = open_logger(run)
        run.stash[_KEY] = logger
    return logger or None


@hookimpl
def distrun_on_fit_start(run):
    _logger(run)


@hookimpl
def distrun_log_metrics(run, step, metrics):
    logger = run.stash.get(_KEY)
    if logger is None:  # validate/test/predict stages have no fit start: open lazily
        logger = _logger(run)
    if logger:
        logger.log(step, metrics)


@hookimpl
def distrun_on_preempt(run, signum):
    logger = run.stash.get(_KEY)
    if logger:
        logger.preempted(128 + signum)


@hookimpl
def distrun_on_exception(run, exc):
    # Finish now, without the plot: the stop handlers are still installed here, and a rank
    # whose peer failed is stopped by its launcher within seconds.
    logger = run.stash.get(_KEY)
    if logger:
        logger.exit_code = 130 if isinstance(exc, KeyboardInterrupt) else 1
        logger.close(run, plot=False)


@hookimpl
def distrun_teardown(run):
    logger = run.stash.pop(_KEY, None)
    if logger:
        logger.close(run)
