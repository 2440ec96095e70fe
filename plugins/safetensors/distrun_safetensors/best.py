"""Best-k checkpoints by a monitored metric (``--ckpt-monitor``, ``--ckpt-mode``,
``--ckpt-save-top-k``). Torch-free.

The metrics reach every rank with the same reduced values, so every rank makes the same
decision and the save goes through the normal (collective) path with reason ``best``. The top
k are not part of the run's state: at the start of each fit they are read back from the
manifests on disk (each best checkpoint records its value under ``monitor``), so they survive a
resume, a resume from another checkpoint and a crash alike.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from distrun.plugin import hookimpl

__all__ = ["Best", "Entry", "TopK", "scan"]


@dataclass(frozen=True)
class Entry:
    value: float
    step: int
    folder: str  # the folder name, ``step-N``


class TopK:
    """The k best ``(value, folder)`` so far for one metric, best first.

    Ties keep the earlier step ahead; a value enters a full list only when strictly better than
    its last entry (as Lightning's ``save_top_k``).
    """

    def __init__(self, name: str, mode: str, k: int, entries: list[Entry] | None = None) -> None:
        self.name, self.mode, self.k = name, mode, k
        self.entries: list[Entry] = []
        for entry in entries or []:
            self.add(entry)

    def _key(self, entry: Entry) -> tuple[float, int]:
        return (entry.value if self.mode == "min" else -entry.value, entry.step)

    def better(self, a: float, b: float) -> bool:
        return a < b if self.mode == "min" else a > b

    def get(self, folder: str) -> Entry | None:
        return next((e for e in self.entries if e.folder == folder), None)

    def qualifies(self, value: float, folder: str) -> bool:
        """Whether ``value`` for ``folder`` would be among the k best."""
        held = self.get(folder)
        if held is not None and not self.better(value, held.value):
            return False  # that checkpoint already carries a value at least as good
        others = [e for e in self.entries if e.folder != folder]
        return len(others) < self.k or self.better(value, others[-1].value)

    def add(self, entry: Entry) -> list[Entry]:
        """Insert ``entry`` (replacing its folder's); return the entries that left the top k."""
        self.discard(entry.folder)
        self.entries.append(entry)
        self.entries.sort(key=self._key)
        dropped, self.entries = self.entries[self.k:], self.entries[:self.k]
        return dropped

    def discard(self, folder: str) -> None:
        self.entries = [e for e in self.entries if e.folder != folder]

    @property
    def first(self) -> str | None:
        return self.entries[0].folder if self.entries else None

    @property
    def names(self) -> frozenset[str]:
        return frozenset(e.folder for e in self.entries)


def scan(ckpt_dir: str, name: str, mode: str) -> list[Entry]:
    """The checkpoints of ``ckpt_dir`` whose manifest carries a value of ``name``/``mode``."""
    from distrun_safetensors.manifest import (
        STEP_RE,
        monitor_record,
        read_manifest_quietly,
        step_folders,
    )

    out = []
    for folder in step_folders(ckpt_dir):
        base = os.path.basename(folder)
        if not STEP_RE.match(base):
            continue  # a folder moved aside by a crashed save of the same step
        record = monitor_record(read_manifest_quietly(folder))
        if record is not None and (record["name"], record["mode"]) == (name, mode):
            out.append(Entry(float(record["value"]), int(record.get("step", 0)), base))
    return out


class Best:
    """The hooks of a run with ``--ckpt-monitor`` (registered for the fit with ``add_hooks``).

    ``distrun_log_metrics`` (every rank, identical values) decides; the save it asks for goes
    through ``run.save_checkpoint("best")``, whose hook asks :meth:`before_save` for the record
    and the retention to hand to the checkpointer.
    """

    def __init__(self, name: str, mode: str, k: int, entries: list[Entry]) -> None:
        self.top = TopK(name, mode, k, entries)
        self.pending: dict[str, Any] | None = None
        self.seen: set[str] = set()
        self.warned_missing = False
        self.warned_nonfinite = False

    # -- the save path ------------------------------------------------------------------------
    def before_save(self, saver: Any, step: int, reason: str) -> tuple[Any, Any]:
        """(record for the manifest or None, Retention) of the save of ``step`` starting now."""
        from distrun_safetensors.retention import Retention

        folder = f"step-{step}"
        record, self.pending = self.pending, None
        if saver.committed(step) is None:
            # a new step-N replaces any folder of that name on disk (an earlier run's): the
            # value it carried goes with it
            self.top.discard(folder)
        if record is not None:
            self.top.add(Entry(record["value"], record["step"], folder))
        top = self.top
        return record, Retention(best=top.first, protect=top.names, monitor=top.name,
                                 mode=top.mode)

    # -- hooks -------------------------------------------------------------------------------
    @hookimpl
    def distrun_log_metrics(self, run: Any, step: int, metrics: Any) -> None:
        self.seen.update(metrics)
        name = self.top.name
        if name not in metrics or getattr(run, "stage", "fit") != "fit":
            return
        value = float(metrics[name])
        if not math.isfinite(value):
            if not self.warned_nonfinite and run.is_global_zero:
                run.log.warning("warning: --ckpt-monitor %s is %s at step %d: never counted "
                                "as one of the best (said once)", name, value, step)
            self.warned_nonfinite = True
            return
        folder = f"step-{run.progress.step}"
        if not self.top.qualifies(value, folder):
            return
        self.pending = {"name": name, "mode": self.top.mode, "value": value, "step": step,
                        "top_k": self.top.k}
        path = run.save_checkpoint("best")
        if run.is_global_zero and path:
            rank = next(i for i, e in enumerate(self.top.entries) if e.folder == folder)
            run.log.info("%s=%.6g at step %d: #%d of the %d best (best: %s)", name, value,
                         step, rank + 1, self.top.k, self.top.first)

    @hookimpl
    def distrun_on_validation_end(self, run: Any, step: int, metrics: Any) -> None:
        # validation reports all its val_* names every time: one without ours never will
        if self.top.name.startswith("val_") and self.top.name not in metrics:
            self.seen.update(metrics)
            self._missing(run)

    @hookimpl
    def distrun_on_epoch_end(self, run: Any, epoch: int) -> None:
        if self.top.name not in self.seen:
            self._missing(run)

    @hookimpl
    def distrun_on_fit_end(self, run: Any) -> None:
        if self.top.name not in self.seen:
            self._missing(run)

    def _missing(self, run: Any) -> None:
        if self.warned_missing:
            return
        self.warned_missing = True
        if run.is_global_zero:
            names = ", ".join(sorted(self.seen)) or "none yet"
            run.log.warning("warning: --ckpt-monitor %s: no such metric was logged, so no best "
                            "checkpoint is saved; the metrics are: %s", self.top.name, names)
