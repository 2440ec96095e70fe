"""The join plugin's options, read typed with ``JoinOptions.of(config)`` (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from distrun.plugin import PluginOptions, option

#: ``--join-mode`` values; see README.md for what each does with the surplus batches
MODES = ("auto", "join", "agree", "off")


@dataclass(frozen=True)
class JoinOptions(PluginOptions, plugin="join"):
    """The join plugin's options (``JoinOptions.of(config)``)."""

    join_mode: str = option(
        "auto",
        "uneven inputs: 'join' wraps each epoch in torch's Join (DDP, ZeRO), 'agree' trains "
        "every rank for the smallest rank's batch count, 'auto' picks join when the model or "
        "optimizer is joinable and agree otherwise (only for per-rank iterables), 'off'",
        choices=MODES)
    join_throw_on_early_termination: bool = option(
        False, "Join: when one rank runs out of batches, every rank stops with an error")
    join_divide_by_initial_world_size: bool = option(
        True, "Join: average gradients over the initial world size even after ranks join (False: "
        "over the ranks still training)")
