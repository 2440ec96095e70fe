"""The ``progress*`` options (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from distrun.plugin import PluginOptions, option


@dataclass(frozen=True)
class ProgressOptions(PluginOptions, plugin="progress"):
    """The progress plugin's options (``ProgressOptions.of(config)``)."""

    progress: bool = option(
        True, "show progress on rank 0: a bar on a terminal, plain lines otherwise")
    progress_mode: str = option(
        "auto", "'auto': a bar when stdout is a terminal, else lines",
        choices=("auto", "bar", "lines"))
    progress_interval: float = option(
        10.0, "seconds between plain progress lines (lines mode)",
        min=0)
