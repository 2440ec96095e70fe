"""Loss, learning-rate and throughput curves of a run's ``metrics.csv`` as an image.

``distrun plot`` draws them on demand; logger plugins (distrun-mlflow, distrun-wandb) attach
the same image to their runs with :func:`plot_run`. matplotlib is imported only when drawing.
"""

from __future__ import annotations

import codecs
import csv
import io
import logging
import os
import shutil
import tempfile
from typing import Any

from distrun._spec.errors import DistrunError, UsageError

__all__ = ["plot_metrics", "plot_run", "read_rows"]

log = logging.getLogger("distrun")

_PANELS = (
    ("loss", "loss", ("loss",), "val_loss"),
    ("learning rate", "lr", ("lr",), None),
    ("throughput", "samples/s", ("samples_per_sec",), None),
)


def _series(rows: list[dict[str, float]], key: str) -> tuple[list[float], list[float]]:
    pairs = [(r["step"], r[key]) for r in rows if key in r and "step" in r]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def read_rows(metrics_csv: str) -> list[dict[str, float]]:
    """The rows of ``metrics_csv`` as dicts of floats (empty cells left out); a file that is
    not such a table (binary bytes, a word in a cell, a row wider than the header) is a
    :class:`UsageError` naming the file and its line."""
    fix = "restore the file, or delete or correct that line"
    try:
        with open(metrics_csv, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise UsageError(f"cannot read {metrics_csv}: {exc.strerror} (check the path and its "
                         "permissions)") from None
    data = data.removeprefix(codecs.BOM_UTF8)  # a spreadsheet may add one
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise UsageError(f"{metrics_csv} line {line} is not text (byte "
                         f"0x{data[exc.start]:02x}): not a metrics.csv, or damaged; "
                         f"{fix}") from None
    reader = csv.DictReader(io.StringIO(text, newline=""))
    rows = []
    try:
        for row in reader:
            out = {}
            for key, cell in row.items():
                if key is None:  # the cells past the header's last column
                    raise UsageError(f"{metrics_csv} line {reader.line_num} has more cells "
                                     f"than its header has columns; {fix}")
                if cell in ("", None):
                    continue
                try:
                    out[key] = float(cell)
                except ValueError:
                    raise UsageError(f"{metrics_csv} line {reader.line_num}, column {key!r}: "
                                     f"{cell[:40]!r} is not a number; {fix}") from None
            rows.append(out)
    except csv.Error as exc:
        raise UsageError(f"{metrics_csv} line {reader.line_num} is not CSV ({exc}); "
                         f"{fix}") from None
    return rows


def plot_metrics(metrics_csv: str, output: str, title: str | None = None) -> list[str]:
    """Render the curves of ``metrics_csv`` into ``output`` (PNG, SVG, PDF by extension).

    :return: the metric names that were drawn.
    """
    rows = read_rows(metrics_csv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("distrun plot needs matplotlib: pip install matplotlib") from None
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
    try:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        fig.savefig(output, dpi=100)
    except OSError as exc:
        if os.path.isfile(output):  # no half-drawn image is left behind
            os.unlink(output)
        raise UsageError(f"cannot write {output}: {exc.strerror} (choose another -o "
                         "path)") from None
    finally:
        plt.close(fig)
    return drawn


def plot_run(run: Any, plugin: str) -> str | None:
    """The run's curves drawn into a fresh temporary folder (the caller removes it), for a
    logger plugin to upload; None, with a warning naming ``plugin``, when there is nothing to
    draw yet (no ``metrics.csv``, no loss) or no matplotlib."""
    from distrun._loggers.csv_file import METRICS_FILE

    csv_path = os.path.join(run.run_dir or ".", METRICS_FILE)
    if not run.run_dir or not os.path.exists(csv_path):
        return None
    folder = tempfile.mkdtemp(prefix=f"{plugin}-")
    out = os.path.join(folder, "metrics.png")
    try:
        plot_metrics(csv_path, out, title=run.config.get("name", "") or None)
    except DistrunError as exc:
        log.warning("warning: %s: no plot logged (%s)", plugin, exc)
        shutil.rmtree(folder, ignore_errors=True)
        return None
    return out
