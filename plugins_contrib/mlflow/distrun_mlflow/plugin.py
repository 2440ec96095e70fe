"""Entry point of distrun-mlflow: an MLflow run per distrun run, written on rank 0.

Importing this module imports neither torch nor mlflow: rank 0 imports mlflow in a background
thread once the strategy is set up (or at the first metrics of a validate/test stage), and
the other ranks never do. The thread writes everything queued since its last write in one
``log_batch``.
"""

from __future__ import annotations

from typing import Any

from distrun.plugin import StashKey, hookimpl
from distrun_mlflow.options import MlflowOptions

DISTRUN_PLUGIN_API = 1  # the distrun.plugin API this plugin is written for

#: the run's writer on rank 0 once opened; False where this plugin stays out of the run
_KEY: StashKey[Any] = StashKey("mlflow")


@hookimpl
def distrun_register_options(register):
    register(MlflowOptions)


def _writer(run: Any) -> Any:
    """The run's writer, started on first use on rank 0; None where this plugin is out."""
    writer = run.stash.get(_KEY)
    if writer is None:
        writer = False
        if run.is_global_zero and MlflowOptions.of(run.config).mlflow \
                and getattr(run, "stage", "fit") != "predict":
            from distrun_mlflow.writer import MlflowWriter, settings_of

            writer = MlflowWriter(settings_of(run))
        run.stash[_KEY] = writer
    return writer or None


@hookimpl
def distrun_setup_strategy(run):
    # The store opens in the background while the model, optimizer and data are built.
    if getattr(run.strategy, "trains", True):
        _writer(run)


@hookimpl
def distrun_on_fit_start(run):
    writer = _writer(run)
    if writer:
        writer.wait_open()  # the run exists in the store before the first step
        if run.resumed_from:
            writer.set_tags({"distrun.resumed_from": str(run.resumed_from)})


@hookimpl
def distrun_log_metrics(run, step, metrics):
    writer = run.stash.get(_KEY)
    if writer is None:  # validate/test stages have no fit start: open at the first row
        writer = _writer(run)
    if writer:
        writer.log(step, metrics)


# The failure hooks write the status at once: the stop handlers are still installed then, and
# a rank whose peer failed is stopped by its launcher within seconds.
@hookimpl
def distrun_on_preempt(run):
    writer = run.stash.get(_KEY)
    if writer:
        writer.end("KILLED")


@hookimpl
def distrun_on_exception(run, exc):
    writer = run.stash.get(_KEY)
    if writer:
        writer.failed = True
        writer.end("KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")


@hookimpl
def distrun_teardown(run):
    writer = run.stash.pop(_KEY, None)
    if writer:
        from distrun_mlflow.writer import close_run

        close_run(run, writer)
