"""``distrun submit``: render scheduler job files (placeholder while being written)."""

from __future__ import annotations

import click


@click.command("submit")
def submit_cmd() -> None:
    """Render a SLURM batch script or a Kubernetes PyTorchJob for a distrun run."""
    raise click.UsageError("not ready yet")
