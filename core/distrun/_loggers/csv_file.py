"""``metrics.csv`` in the run folder: one row per ``distrun_log_metrics`` call, rank 0 only.

Columns are ``step``, ``epoch``, ``time`` (seconds since the fit started) and every metric in
the order it first appeared (``loss``, ``samples_per_sec``, ``lr``, ``val_*``...). A new column
rewrites the (small) file; otherwise rows are appended. On resume, rows after the restored
step are dropped so the file reads as one run (each step once), and rank 0 says so in one line.

A row reaches the file whole or not at all: it is appended in one ``write`` of its bytes, and a
write cut short (a full disk) is truncated away; a rewrite goes through a temporary file that
replaces the old one only once it is complete. A failed write (``ENOSPC``, a quota, a
read-only folder) is warned about once and never stops training: the rows from there on are
kept in memory and written, whole, at the end of the run if there is room by then.
"""

from __future__ import annotations

import csv
import io
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from distrun._spec.markers import hookimpl
from distrun._spec.options import Option
from distrun._spec.stash import StashKey

__all__ = ["METRICS_FILE", "CsvLogger", "read_metrics", "replaced_rows_line"]

METRICS_FILE = "metrics.csv"
_KEY: StashKey[CsvLogger] = StashKey("csv_logger")
log = logging.getLogger(__name__)


def read_metrics(path: str) -> list[dict[str, float]]:
    """Rows of a ``metrics.csv`` as dicts of floats (empty cells left out)."""
    with open(path, newline="") as fh:
        return [{k: float(v) for k, v in row.items() if v not in ("", None)}
                for row in csv.DictReader(fh)]


class CsvLogger:
    """Appends metric rows to ``path``; a new column rewrites the file with the wider header."""

    def __init__(self, path: str, keep_until_step: int | None = None,
                 warn: Callable[[str], None] | None = None) -> None:
        self.path = path
        self.columns = ["step", "epoch", "time"]
        self.rows: list[dict[str, float]] = []
        self._fd: int | None = None  # the file, open for appending once a row is appended
        self._size = 0  # its length: where a write cut short is truncated back to
        self.started = time.time()
        #: says why the file stopped being written (once)
        self.warn = warn or log.warning
        #: why writing the file failed (None: it is written as rows come)
        self.failed: str | None = None
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
        if self.failed is not None:
            return  # kept in memory: close() tries once more
        if new:
            self._rewrite()
        else:
            self._append(row)

    def close(self) -> None:
        """Close the file; after a failed write, one more try at writing every row."""
        self._close_fd()
        if self.failed is not None:
            self._rewrite(retry=True)

    def _close_fd(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _text(self, rows: list[dict[str, float]], header: bool = False) -> bytes:
        buf = io.StringIO(newline="")
        writer = csv.DictWriter(buf, fieldnames=self.columns)
        if header:
            writer.writeheader()
        for row in rows:
            writer.writerow(self._cells(row))
        return buf.getvalue().encode()

    def _cells(self, row: Mapping[str, float]) -> dict[str, str]:
        out = {}
        for key, value in row.items():
            out[key] = str(int(value)) if key == "step" else f"{value:.8g}"
        return out

    def _append(self, row: Mapping[str, float]) -> None:
        """Append one row in one write (the file is whole if the process dies); a write cut
        short is truncated away, so no torn row is left."""
        text = self._text([dict(row)])
        data = memoryview(text)
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
                self._size = os.fstat(self._fd).st_size
            while data:
                data = data[os.write(self._fd, data):]
        except OSError as exc:
            if self._fd is not None:
                try:
                    os.ftruncate(self._fd, self._size)
                except OSError:
                    pass  # nothing more can be done about it; it is said below
            self._fail(exc)
            return
        self._size += len(text)

    def _rewrite(self, retry: bool = False) -> None:
        """Write every row to a temporary file that replaces ``path`` once complete."""
        self._close_fd()
        tmp = f"{self.path}.tmp"
        try:
            with open(tmp, "wb") as fh:
                fh.write(self._text(self.rows, header=True))
            os.replace(tmp, self.path)
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if not retry:
                self._fail(exc)
            return
        self.failed = None

    def _fail(self, exc: OSError) -> None:
        self._close_fd()
        self.failed = exc.strerror or str(exc)
        step = int(self.rows[-1]["step"]) if self.rows else 0
        self.warn(f"warning: cannot write {self.path} ({self.failed}) at step {step}: training "
                  "goes on; the rows from there on are kept in memory and written at the end "
                  "of the run if there is room by then")


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
    logger = run.stash[_KEY] = CsvLogger(path, keep_until_step=keep,
                                         warn=lambda line: run.log.warning("%s", line))
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
