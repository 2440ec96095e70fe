"""distrun-wandb: config, metrics, the loss plot and the exit code of a run in W&B (rank 0)."""
