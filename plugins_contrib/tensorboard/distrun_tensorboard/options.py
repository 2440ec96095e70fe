"""The tensorboard plugin's options, read typed with ``TensorBoardOptions.of(config)`` (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from distrun.plugin import PluginOptions, option


@dataclass(frozen=True)
class TensorBoardOptions(PluginOptions, plugin="tensorboard"):
    """The tensorboard plugin's options (``TensorBoardOptions.of(config)``)."""

    tensorboard: bool = option(True, "write TensorBoard event files on rank 0")
    tensorboard_dir: str = option("", "event file folder (default: RUN_DIR/tensorboard)")
    tensorboard_flush_secs: float = option(
        30.0, "seconds between flushes of the event file",
        min=0)
