"""The wandb plugin's options, read typed with ``WandbOptions.of(config)`` (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from distrun.plugin import PluginOptions, option


@dataclass(frozen=True)
class WandbOptions(PluginOptions, plugin="wandb"):
    """The wandb plugin's options (``WandbOptions.of(config)``)."""

    wandb: bool = option(
        False,
        "log config, metrics and the loss plot to Weights & Biases on rank 0 (offline unless "
        "--wandb-mode online)")
    wandb_mode: str = option(
        "auto", "with --wandb; offline: write RUN_DIR/wandb only (upload later with wandb sync); "
        "online: stream to the server; disabled: no W&B at all; auto: $WANDB_MODE if set, else "
        "offline",
        choices=("auto", "offline", "online", "disabled"))
    wandb_project: str = option("", "W&B project (default: $WANDB_PROJECT, else distrun)")
    wandb_entity: str = option(
        "", "W&B entity, a user or team (default: $WANDB_ENTITY, else your default entity)")
    wandb_run_name: str = option("", "W&B run name (default: the run name)")
    wandb_tags: str = option(
        "", "comma-separated tags of the W&B run, e.g. baseline,ddp",
        metavar="TAG,...")
    wandb_log_plot: bool = option(
        True,
        "log the loss/lr/throughput plot of metrics.csv as the image metrics_plot at the end "
        "(needs matplotlib)")
