"""Entry point of distrun-tensorboard: TensorBoard event files on rank 0 (torch-free import).

Every ``distrun_log_metrics`` call becomes scalars (``loss``, ``lr``, ``samples_per_sec``,
``epoch``, ``val_*``) at the global step, written with torch's ``SummaryWriter`` into
``RUN_DIR/tensorboard`` (or ``--tensorboard-dir``). View with ``tensorboard --logdir runs``.
"""

from __future__ import annotations

from typing import Any

from distrun.plugin import StashKey, hookimpl
from distrun_tensorboard.options import TensorBoardOptions

DISTRUN_PLUGIN_API = 1  # the distrun.plugin API this plugin is written for

_KEY: StashKey[Any] = StashKey("tensorboard")  # the SummaryWriter, rank 0 only


@hookimpl
def distrun_register_options(register):
    register(TensorBoardOptions)


@hookimpl
def distrun_on_fit_start(run):
    _writer(run)


def _writer(run: Any) -> Any:
    """The run's writer, opened at fit start or (an evaluation alone) at the first row."""
    writer = run.stash.get(_KEY)
    if writer is None and run.is_global_zero and TensorBoardOptions.of(run.config).tensorboard:
        from distrun_tensorboard.writer import open_writer

        writer = run.stash[_KEY] = open_writer(run)
    return writer


@hookimpl
def distrun_log_metrics(run, step, metrics):
    writer = _writer(run)
    if writer is not None:
        for name, value in metrics.items():
            if name != "step":
                writer.add_scalar(name, float(value), global_step=step)


@hookimpl
def distrun_on_validation_end(run, step, metrics):
    writer = run.stash.get(_KEY)
    if writer is not None:
        writer.flush()


@hookimpl
def distrun_teardown(run):
    writer = run.stash.pop(_KEY, None)
    if writer is not None:
        writer.close()
