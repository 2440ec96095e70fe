"""``distrun plot RUN_DIR -o loss.png``: loss, learning-rate and throughput curves of a run.

Reads the run folder's ``metrics.csv``; matplotlib is imported only when the command runs.
"""

from __future__ import annotations

import os
from typing import Any

import click

from distrun._loggers.plot import plot_metrics
from distrun._spec.errors import UsageError
from distrun._spec.markers import hookimpl

__all__ = ["plot_cmd"]

def _find_csv(run_dir: str) -> str:
    from distrun._loggers.csv_file import METRICS_FILE

    path = run_dir if run_dir.endswith(".csv") else os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        raise UsageError(f"no metrics file at {path} (give a run folder such as runs/NAME, "
                         "or the path of a metrics.csv)")
    return path


@click.command("plot")
@click.argument("run_dir")
@click.option("-o", "--output", default=None,
              help="image to write (.png, .svg, .pdf)  [default: RUN_DIR/metrics.png]")
def plot_cmd(run_dir: str, output: str | None) -> None:
    """Plot loss, learning rate and throughput of RUN_DIR (its metrics.csv) to an image."""
    path = _find_csv(run_dir)
    output = output or os.path.join(os.path.dirname(path), "metrics.png")
    drawn = plot_metrics(path, output, title=os.path.basename(os.path.dirname(
        os.path.abspath(path))))
    click.echo(f"wrote {output} ({', '.join(drawn)})")


@hookimpl
def distrun_add_commands(cli: Any) -> None:
    cli.add_command(plot_cmd)
