"""The amp plugin's options, read typed with ``AmpOptions.of(config)`` (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from distrun.plugin import PluginOptions, option


@dataclass(frozen=True)
class AmpOptions(PluginOptions, plugin="amp"):
    """The amp plugin's options (``AmpOptions.of(config)``)."""

    precision: str = option(
        "32-true",
        "numeric precision: 32-true, bf16-mixed (autocast), 16-mixed (autocast + GradScaler, "
        "CUDA)",
        choices=("32-true", "bf16-mixed", "16-mixed"))
