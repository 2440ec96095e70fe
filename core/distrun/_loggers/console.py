"""A plain metrics line on rank 0 at each log step, so a run is never silent.

A plugin that shows metrics its own way (a progress bar) mutes it for the run by setting
``run.stash[CONSOLE_OWNER]`` (:mod:`distrun._spec.keys`) to its name; a user mutes it with ``--no-console``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from distrun._spec.keys import CONSOLE_OWNER
from distrun._spec.markers import hookimpl
from distrun._spec.options import Option

__all__ = ["format_metrics"]

_FIRST = ("epoch", "step", "loss", "samples_per_sec", "lr")


def _number(value: float) -> str:
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
        return f"{value:.3e}"
    return f"{value:.4f}"


def format_metrics(step: int, metrics: Mapping[str, Any]) -> str:
    """``epoch 0 | step 20 | loss 0.1234 | 812.3 samples/s | lr 1.000e-03 | val_loss 0.2``."""
    parts = []
    if "epoch" in metrics:
        parts.append(f"epoch {int(metrics['epoch'])}")
    parts.append(f"step {step}")
    if "loss" in metrics:
        parts.append(f"loss {_number(float(metrics['loss']))}")
    if "samples_per_sec" in metrics:
        parts.append(f"{float(metrics['samples_per_sec']):.1f} samples/s")
    if "lr" in metrics:
        parts.append(f"lr {float(metrics['lr']):.3e}")
    for key, value in metrics.items():
        if key not in _FIRST:
            parts.append(f"{key} {_number(float(value))}")
    return " | ".join(parts)


@hookimpl
def distrun_register_options(register):
    register(Option("console", bool, True, plugin="console",
                    help="print a plain metrics line on rank 0 at each log step"))


@hookimpl
def distrun_log_metrics(run, step, metrics):
    if not run.is_global_zero or not run.config.get("console", True):
        return
    if run.stash.get(CONSOLE_OWNER):
        return
    run.log.info(format_metrics(step, metrics))
