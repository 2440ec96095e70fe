"""Relay the workers' log files to the launcher's terminal, as the core launcher relays pipes.

Torch's agent writes each worker's stdout and stderr into per-attempt files; one thread per
file follows it and prints each line (``--tee`` prefixes ``[rankN]: ``, like the core). The
last lines of every rank are kept so a failure can be reported once, with its own lines. An
``error: ...`` line (a usage error) that several ranks print is said once.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
from typing import IO

from distrun.launch.local import TAIL_LINES

__all__ = ["Relay"]

_POLL = 0.05


class _Tail:
    """What ``distrun.launch.local.report_failure`` needs of a worker: its rank and last lines."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)


class Relay:
    """Follow the files of the current attempt; :meth:`next_attempt` for each (re)start."""

    def __init__(self, tee: bool = False) -> None:
        self.tee = tee
        self._lock = threading.Lock()
        self._seen_errors: set[str] = set()
        self._finished = threading.Event()
        self._threads: list[threading.Thread] = []
        self.tails: dict[int, _Tail] = {}

    def next_attempt(self, files: dict[int, tuple[str, str]]) -> None:
        """Follow ``{global_rank: (stdout_path, stderr_path)}``; let the last attempt drain."""
        self._finished.set()
        finished = self._finished = threading.Event()
        self.tails = {rank: _Tail(rank) for rank in files}
        for rank, (out, err) in files.items():
            for path, dst in ((out, sys.stdout), (err, sys.stderr)):
                if not path:
                    continue
                t = threading.Thread(target=self._follow,
                                     args=(self.tails[rank], path, dst, finished), daemon=True)
                t.start()
                self._threads.append(t)

    def close(self, timeout: float = 5.0) -> None:
        """Print what is left in the files and stop following them."""
        self._finished.set()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        self._threads = [t for t in self._threads if t.is_alive()]

    def _follow(self, worker: _Tail, path: str, dst: IO[str], finished: threading.Event) -> None:
        while not os.path.exists(path):
            if finished.is_set():
                return
            time.sleep(_POLL)
        with open(path, errors="replace") as fh:
            pending = ""
            while True:
                chunk = fh.readline()
                if chunk:
                    pending += chunk
                    if pending.endswith("\n"):
                        self._emit(worker, pending, dst)
                        pending = ""
                    continue
                if finished.is_set():
                    # The attempt is over: whatever came after the last read, then stop.
                    rest = pending + fh.read()
                    for line in rest.splitlines():
                        self._emit(worker, line + "\n", dst)
                    return
                time.sleep(_POLL)

    def _emit(self, worker: _Tail, line: str, dst: IO[str]) -> None:
        worker.tail.append(line.rstrip("\n"))
        with self._lock:
            if line.startswith("error: "):
                if line in self._seen_errors:
                    return
                self._seen_errors.add(line)
            dst.write(f"[rank{worker.rank}]: {line}" if self.tee else line)
            dst.flush()
