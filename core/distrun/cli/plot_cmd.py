"""``distrun plot RUN_DIR -o loss.png``: loss, learning-rate and throughput curves of a run.

Reads the run folder's ``metrics.csv``; matplotlib is imported only when the command runs.
"""

from __future__ import annotations

import os
from typing import Any

import click

from distrun.spec.errors import UsageError
from distrun.spec.markers import hookimpl

__all__ = ["plot_metrics"]

_PANELS = (
    ("loss", "loss", ("loss",), "val_loss"),
    ("learning rate", "lr", ("lr",), None),
    ("throughput", "samples/s", ("samples_per_sec",), None),
)


def _series(rows: list[dict[str, float]], key: str) -> tuple[list[float], list[float]]:
    pairs = [(r["step"], r[key]) for r in rows if key in r and "step" in r]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plot_metrics(metrics_csv: str, output: str, title: str | None = None) -> list[str]:
    """Render the curves of ``metrics_csv`` into ``output`` (PNG, SVG, PDF by extension).

    :return: the metric names that were drawn.
    """
    from distrun.loggers.csv_file import read_metrics

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("distrun plot needs matplotlib: pip install matplotlib") from None
    rows = read_metrics(metrics_csv)
    panels = [p for p in _PANELS if any(k in r for r in rows for k in (*p[2], p[3] or ""))]
    if not panels:
        raise UsageError(f"{metrics_csv} has no loss, lr or samples_per_sec values to plot "
                         "(let the run reach a log step: --log-every-n-steps)")
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.6 * len(panels)), sharex=True,
                             squeeze=False)
    drawn = []
    for ax, (name, unit, keys, val_key) in zip(axes[:, 0], panels, strict=True):
        for key in (*keys, val_key) if val_key else keys:
            xs, ys = _series(rows, key)
            if xs:
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=key)
                drawn.append(key)
        ax.set_ylabel(unit)
        ax.set_title(name, fontsize=10)
        ax.grid(True, alpha=0.3)
        if len(ax.get_lines()) > 1:
            ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel("step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return drawn


def _find_csv(run_dir: str) -> str:
    from distrun.loggers.csv_file import METRICS_FILE

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
