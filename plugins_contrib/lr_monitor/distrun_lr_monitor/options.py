"""The lr_monitor plugin's options, read typed with ``LrMonitorOptions.of(config)`` (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from distrun.plugin import PluginOptions, option


@dataclass(frozen=True)
class LrMonitorOptions(PluginOptions, plugin="lr_monitor"):
    """The lr_monitor plugin's options (``LrMonitorOptions.of(config)``)."""

    lr_monitor: bool = option(
        False, "log each param group's learning rate as lr-<group> with the training metrics")
    lr_monitor_momentum: bool = option(
        False, "also log each group's momentum as momentum-<group> (SGD's momentum, Adam's beta1)")
