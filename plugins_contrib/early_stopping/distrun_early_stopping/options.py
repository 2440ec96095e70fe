"""The early_stopping plugin's options, read typed with ``EarlyStoppingOptions.of(config)`` (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from distrun.plugin import PluginOptions, option
from distrun_early_stopping.rule import MODES


@dataclass(frozen=True)
class EarlyStoppingOptions(PluginOptions, plugin="early_stopping"):
    """The early_stopping plugin's options (``EarlyStoppingOptions.of(config)``)."""

    early_stop_monitor: str = option(
        "", "stop the fit when this logged metric stops improving, e.g. val_loss (empty: off)",
        metavar="METRIC")
    early_stop_mode: str = option(
        "min", "min: lower is better; max: higher is better",
        choices=MODES)
    early_stop_patience: int = option(
        3, "checks in a row without improvement before stopping",
        min=0)
    early_stop_min_delta: float = option(
        0.0, "a change no larger than this does not count as an improvement",
        min=0)
    early_stop_check_finite: bool = option(
        True, "stop at once when the monitored value is NaN or infinite")
    early_stop_stopping_threshold: float | None = option(
        None, "stop as soon as the value is better than this (unset: off)")
    early_stop_divergence_threshold: float | None = option(
        None, "stop as soon as the value is worse than this (unset: off)")
