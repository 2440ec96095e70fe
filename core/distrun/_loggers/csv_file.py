"""``metrics.csv`` in the run folder: one row per ``distrun_log_metrics`` call, rank 0 only.

Columns are ``step``, ``epoch``, ``time`` (seconds since the fit started) and every metric in
the order it first appeared (``loss``, ``samples_per_sec``, ``lr``, ``val_*``...). A new column
rewrites the (small) file; otherwise rows are appended. On resume, rows after the restored
step are dropped so the file reads as one run (each step once), and rank 0 says so in one line.
"""

from __future__ import annotations

import csv
import os
import time
from collections.abc import Mapping
from typing import Any

from distrun._spec.markers import hookimpl
from distrun._spec.options import Option
from distrun._spec.stash import StashKey

__all__ = ["METRICS_FILE", "CsvLogger", "read_metrics", "replaced_rows_line"]

METRICS_FILE = "metrics.csv"
_KEY: StashKey[CsvLogger] = StashKey("csv_logger")


def read_metrics(path: str) -> list[dict[str, float]]:
    """Rows of a ``metrics.csv`` as dicts of floats (empty cells left out)."""
    with open(path, newline="") as fh:
        return [{k: float(v) for k, v in row.items() if v not in ("", None)}
                for row in csv.DictReader(fh)]


class CsvLogger:
    """Appends metric rows to ``path``; a new column rewrites the file with the wider header."""

    def __init__(self, path: str, keep_until_step: int | None = None) -> None:
        self.path = path
        self.columns = ["step", "epoch", "time"]
        self.rows: list[dict[str, float]] = []
        self._fh: Any = None  # the file, open for appending once a row is appended
        self._append: Any = None
        self.started = time.time()
        #: the steps of the rows dropped on resume (the run went back before them)
        self.dropped: list[int] = []
        if keep_until_step is not None and os.path.exists(path):
            rows = read_metrics(path)
            self.rows = [r for r in rows if r.get("step", 0) <= keep_until_step]
            self.dropped = [int(r.get("step", 0)) for r in rows
                            if r.get("step", 0) > keep_until_step]
            for row in self.rows:
                self.columns += [k for k in row if k not in self.columns]
            if self.rows:
                self.started -= self.rows[-1].get("time", 0.0)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self._rewrite()

    def log(self, step: int, epoch: float, metrics: Mapping[str, Any]) -> None:
        row = {"step": float(step), "epoch": float(epoch),
               "time": round(time.time() - self.started, 3)}
        row.update({k: float(v) for k, v in metrics.items() if k not in row})
        self.rows.append(row)
        new = [k for k in row if k not in self.columns]
        if new:
            self.columns += new
            self._rewrite()
            return
        if self._fh is None:
            self._fh = open(self.path, "a", newline="")  # noqa: SIM115 (kept open; close())
            self._append = self._writer(self._fh)
        self._append.writerow(self._cells(row))
        self._fh.flush()  # one write per row: the file is whole if the process dies

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def _writer(self, fh: Any) -> Any:
        return csv.DictWriter(fh, fieldnames=self.columns)

    def _cells(self, row: Mapping[str, float]) -> dict[str, str]:
        out = {}
        for key, value in row.items():
            out[key] = str(int(value)) if key == "step" else f"{value:.8g}"
        return out

    def _rewrite(self) -> None:
        self.close()
        tmp = f"{self.path}.tmp"
        with open(tmp, "w", newline="") as fh:
            writer = self._writer(fh)
            writer.writeheader()
            for row in self.rows:
                writer.writerow(self._cells(row))
        os.replace(tmp, self.path)


@hookimpl
def distrun_register_options(register):
    register(Option("csv", bool, True, plugin="csv_logger",
                    help="write metrics.csv to the run folder (rank 0)"))


@hookimpl
def distrun_on_fit_start(run):
    _open(run)


def _open(run: Any) -> CsvLogger | None:
    """The run's logger, opened at the first fit start or, in an evaluation alone, at the
    first row. A fit keeps the rows up to the step it resumed from; an evaluation keeps
    every earlier row (it adds its own to the run's file)."""
    logger = run.stash.get(_KEY)
    if logger is not None or not run.is_global_zero or not run.config.get("csv", True) \
            or not run.run_dir:
        return logger
    if run.stage == "fit":
        keep = run.progress.step if run.resumed_from else None
    else:
        keep = run.progress.step if run.resumed_from else -1
    path = os.path.join(run.run_dir, METRICS_FILE)
    if keep == -1:
        keep = 1 << 62 if os.path.exists(path) else None
    logger = run.stash[_KEY] = CsvLogger(path, keep_until_step=keep)
    if logger.dropped:
        run.log.info("%s", replaced_rows_line(logger.dropped, run.progress.step,
                                              run.resumed_from))
    return logger


def replaced_rows_line(steps: list[int], resumed_step: int, source: str | None) -> str:
    """The log line of a resume that rolled ``metrics.csv`` back past the rows of ``steps``."""
    lo, hi = min(steps), max(steps)
    which = f"step {lo}" if lo == hi else f"steps {lo} to {hi}"
    rows = f"{len(steps)} row{'s' * (len(steps) != 1)}"
    return (f"metrics.csv: replacing {rows} of {which}: the run went back to step "
            f"{resumed_step} (resumed from {source})")


@hookimpl
def distrun_log_metrics(run, step, metrics):
    logger = _open(run)
    if logger is not None:
        logger.log(step, metrics.get("epoch", run.progress.epoch), metrics)


@hookimpl
def distrun_teardown(run):
    logger = run.stash.get(_KEY)
    if logger is not None:
        logger.close()
