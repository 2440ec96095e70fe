"""Workers' output to the launcher's terminal, line by line; every launcher uses this one.

Each line goes to the launcher's stdout or stderr as the worker wrote it (``--tee`` prefixes
``[rankN]: ``), into the rank's log file when it has one, and into the rank's tail: its last
:data:`TAIL_LINES` lines, shown once when the rank fails. An ``error: ...`` line (a usage error)
that several ranks print is said once. Torch-free.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Protocol

__all__ = ["TAIL_LINES", "RankLines", "RankOutput", "Relay", "new_tail", "report_failure"]

#: lines of a rank kept for its failure report
TAIL_LINES = 20
_POLL = 0.05


def new_tail() -> collections.deque[str]:
    """An empty tail: the last :data:`TAIL_LINES` lines of one rank."""
    return collections.deque(maxlen=TAIL_LINES)


class RankLines(Protocol):
    """What the relay needs of a rank: its number, its tail and its log file (or None)."""

    rank: int
    tail: collections.deque[str]
    log: IO[str] | None


@dataclass
class RankOutput:
    """A plain :class:`RankLines`, for launchers that keep nothing else about a rank."""

    rank: int
    tail: collections.deque[str] = field(default_factory=new_tail)
    log: IO[str] | None = None


class Relay:
    """Print the lines of many ranks without mixing them; thread-safe."""

    def __init__(self, tee: bool = False,
                 show: Callable[[int, IO[str]], bool] | None = None) -> None:
        self.tee = tee
        #: whether a line of rank N bound for ``dst`` reaches the console (torchrun's
        #: ``--redirects`` and ``--local-ranks-filter``); it goes to the log file regardless
        self.show = show
        #: held while a line is written (and while a rank's log file is closed)
        self.lock = threading.Lock()
        self._seen_errors: set[str] = set()

    def emit(self, rank: RankLines, line: str, dst: IO[str]) -> None:
        """Relay one line (with its newline) of ``rank`` to ``dst``."""
        rank.tail.append(line.rstrip("\n"))
        with self.lock:
            if rank.log is not None and not rank.log.closed:
                rank.log.write(line)
                rank.log.flush()
            if self.show is not None and not self.show(rank.rank, dst):
                setattr(rank, "hidden", True)  # noqa: B010 - its report repeats its lines
                return
            # The same usage error (or warning) from N ranks is said once.
            if line.startswith(("error: ", "warning: ")):
                if line in self._seen_errors:
                    return
                self._seen_errors.add(line)
            dst.write(f"[rank{rank.rank}]: {line}" if self.tee else line)
            dst.flush()

    def pipe(self, rank: RankLines, src: IO[str], dst: IO[str]) -> threading.Thread:
        """Relay every line of the pipe ``src`` in a daemon thread, until it closes."""

        def run() -> None:
            for line in src:
                self.emit(rank, line, dst)
            src.close()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    def follow(self, rank: RankLines, path: str, dst: IO[str],
               finished: threading.Event) -> threading.Thread:
        """Relay the lines a worker writes into the file ``path`` (it may not exist yet).

        Runs in a daemon thread until ``finished`` is set; then whatever is left in the file
        is relayed and the thread ends.
        """
        thread = threading.Thread(target=self._follow, args=(rank, path, dst, finished),
                                  daemon=True)
        thread.start()
        return thread

    def _follow(self, rank: RankLines, path: str, dst: IO[str],
                finished: threading.Event) -> None:
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
                        self.emit(rank, pending, dst)
                        pending = ""
                    continue
                if finished.is_set():
                    # Over: whatever came after the last read, then stop.
                    rest = pending + fh.read()
                    for line in rest.splitlines():
                        self.emit(rank, line + "\n", dst)
                    return
                time.sleep(_POLL)


def report_failure(rank: RankLines, code: int, where: str = "") -> None:
    """Say once, in one line, that ``rank`` failed with exit ``code``.

    Its output (a traceback, say) is already on the console, so the line names the rank and
    its last line; the last lines are repeated only for a rank whose output the console did
    not show (``--redirects``, ``--local-ranks-filter``). ``where`` (e.g. ``Ray node
    10.0.0.5``) is added after the rank. Nothing is said when the rank's last line was a usage
    error: it was already said, in one line.
    """
    lines = [ln for ln in rank.tail if ln.strip()]
    if lines and lines[-1].startswith("error: "):
        return
    place = f" ({where})" if where else ""
    head = f"distrun: rank {rank.rank}{place} failed with exit code {code}"
    if not getattr(rank, "hidden", False):
        last = f": {lines[-1].strip()[:200]}" if lines else ""
        print(f"{head}{last}" + (" (its output is above)" if lines else ""), file=sys.stderr)
        sys.stderr.flush()
        return
    print(f"{head}; its last lines:", file=sys.stderr)
    for ln in lines[-TAIL_LINES:]:
        print(f"  [rank{rank.rank}] {ln}", file=sys.stderr)
    sys.stderr.flush()
