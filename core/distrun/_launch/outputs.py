"""Where the output of a node's workers goes: torchrun's ``--log-dir``, ``--redirects`` and
``--local-ranks-filter``, and torch's ``@record`` error files (torch-free)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO

from distrun._config.run_config import RunConfig

__all__ = ["WorkerOutputs", "worker_outputs"]


def _streams(value: str, local_rank: int) -> int:
    """torchrun's ``--redirects`` value for one local rank: 0 none, 1 out, 2 err, 3 both."""
    if ":" not in value:
        return int(value)
    table = dict(item.split(":") for item in value.split(","))
    return int(table.get(str(local_rank), "0"))


@dataclass
class WorkerOutputs:
    """Where a group's output goes: the log folder, torch's error files, the console filter."""

    log_dir: str | None = None
    error_dir: str | None = None  # None: no error files
    temporary: str | None = None  # a folder of ours to remove at the end
    show: Callable[[int, IO[str]], bool] | None = None

    @classmethod
    def of(cls, config: RunConfig, first_rank: int) -> WorkerOutputs:
        """The outputs ``config`` asks for (see :func:`worker_outputs`); ``first_rank``: the
        global rank of this node's local rank 0."""
        return worker_outputs(config, first_rank)

    def error_file(self, rank: int) -> str | None:
        return os.path.join(self.error_dir, f"rank{rank}.error.json") if self.error_dir else None

    def cleanup(self) -> None:
        if self.temporary:
            shutil.rmtree(self.temporary, ignore_errors=True)
            self.temporary = None


def worker_outputs(config: RunConfig, first_rank: int) -> WorkerOutputs:
    """torchrun's --log-dir, --redirects and --local-ranks-filter for this node's workers.

    Logs go to ``--log-dir`` or ``RUN_DIR/logs`` when there is a run folder, else nowhere;
    torch's error files go beside them, or into a temporary folder removed at the end (as
    torchrun's own). Redirected output needs files: without a log folder it goes to a kept
    temporary one, said once.
    """
    log_dir = config.log_dir or (os.path.join(config.run_dir, "logs") if config.run_dir else None)
    temporary = None
    redirected = config.redirects not in ("0", "")
    if redirected and not log_dir:
        log_dir = tempfile.mkdtemp(prefix="distrun-logs-")
        sys.stderr.write(
            f"distrun: --redirects {config.redirects}: worker output goes to {log_dir}\n"
        )
    if log_dir:
        error_dir = os.path.abspath(log_dir)  # a worker may change its directory
    else:
        error_dir = temporary = tempfile.mkdtemp(prefix="distrun-errors-")
    shown = {int(r) for r in config.local_ranks_filter.split(",") if r}

    def show(rank: int, dst: IO[str]) -> bool:
        local = rank - first_rank
        if shown and local not in shown:
            return False
        if redirected:
            mask = _streams(config.redirects, local)
            return not mask & (2 if dst is sys.stderr else 1)
        return True

    return WorkerOutputs(log_dir, error_dir, temporary, show if shown or redirected else None)
