"""Workers' output to the launcher's terminal, line by line; every launcher uses this one.

Each line goes to the launcher's stdout or stderr as the worker wrote it (``--tee`` prefixes
``[rankN]: ``), into the rank's log file when it has one, and into the rank's tail: its last
:data:`TAIL_LINES` lines, shown once when the rank fails (its stderr lines are kept apart too:
the failure line quotes the rank's last line on stderr, where its error is, whatever order the
two pipes were read in). An ``error: ...`` line (a usage error) that several ranks print is
said once, and so is a traceback: a Python traceback is printed as one block when complete,
and the same block from another rank is not printed again (the failure line names the ranks
that failed the same way). Everything still goes to each rank's log file. Torch-free.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
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
    """What the relay needs of a rank: its number, its tail and its log file (or None).

    A rank that also has an ``err_tail`` deque gets its stderr lines there as well, and its
    failure line quotes the last of them.
    """

    rank: int
    tail: collections.deque[str]
    log: IO[str] | None


@dataclass
class RankOutput:
    """A plain :class:`RankLines`, for launchers that keep nothing else about a rank."""

    rank: int
    tail: collections.deque[str] = field(default_factory=new_tail)
    log: IO[str] | None = None
    err_tail: collections.deque[str] = field(default_factory=new_tail)


#: the line that opens a Python traceback; the block ends at the first line not indented
_TRACEBACK = "Traceback (most recent call last):"


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
        #: a traceback being read, per (rank, stream); printed as one block when complete
        self._pending: dict[tuple[int, int], list[str]] = {}
        #: each traceback printed: the block -> the ranks that printed it, first one first
        self._tracebacks: dict[tuple[str, ...], list[int]] = {}
        #: the last traceback of each rank
        self._last_traceback: dict[int, tuple[str, ...]] = {}

    def emit(self, rank: RankLines, line: str, dst: IO[str]) -> None:
        """Relay one line (with its newline) of ``rank`` to ``dst``."""
        rank.tail.append(line.rstrip("\n"))
        err_tail = getattr(rank, "err_tail", None)
        if dst is sys.stderr and err_tail is not None:
            err_tail.append(line.rstrip("\n"))
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
            self._write(rank, self._traceback_lines(rank, line, dst), dst)

    def flush(self, rank: RankLines, dst: IO[str]) -> None:
        """Print what is left of a traceback ``rank`` did not finish on ``dst`` (its end)."""
        with self.lock:
            self._write(rank, self._pending.pop((rank.rank, id(dst)), []), dst)

    def same_failure(self, rank: int) -> list[int]:
        """The other ranks whose last traceback was the same as ``rank``'s (not printed
        again), in rank order."""
        with self.lock:
            block = self._last_traceback.get(rank)
            return sorted(r for r, b in self._last_traceback.items() if b == block and r != rank) \
                if block is not None else []

    def new_attempt(self) -> None:
        """Forget the tracebacks printed so far (a restarted group prints its own again)."""
        with self.lock:
            self._tracebacks.clear()
            self._last_traceback.clear()

    def _write(self, rank: RankLines, lines: list[str], dst: IO[str]) -> None:
        if not lines:
            return
        dst.write("".join(f"[rank{rank.rank}]: {ln}" if self.tee else ln for ln in lines))
        dst.flush()

    def _traceback_lines(self, rank: RankLines, line: str, dst: IO[str]) -> list[str]:
        """The lines to print now for ``line``: a traceback waits until its last line, then
        is printed whole, or not at all when another rank printed the same block."""
        key = (rank.rank, id(dst))
        block = self._pending.get(key)
        if block is None:
            if line.rstrip("\n") != _TRACEBACK:
                return [line]
            self._pending[key] = [line]
            return []
        block.append(line)
        if line[:1] in (" ", "\t"):
            return []  # a frame: the block goes on
        del self._pending[key]  # the exception's line ends it
        text = tuple(block)
        self._last_traceback[rank.rank] = text
        ranks = self._tracebacks.setdefault(text, [])
        first = not ranks or ranks == [rank.rank]
        if rank.rank not in ranks:
            ranks.append(rank.rank)
        return block if first else []

    def pipe(self, rank: RankLines, src: IO[str], dst: IO[str]) -> threading.Thread:
        """Relay every line of the pipe ``src`` in a daemon thread, until it closes."""

        def run() -> None:
            for line in src:
                self.emit(rank, line, dst)
            self.flush(rank, dst)
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
                    self.flush(rank, dst)
                    return
                time.sleep(_POLL)


def report_failure(rank: RankLines, code: int, where: str = "",
                   same: Sequence[int] = ()) -> None:
    """Say once, in one line, that ``rank`` failed with exit ``code``.

    Its output (a traceback, say) is already on the console, so the line names the rank and
    its last line on stderr (its last line at all when it wrote nothing there); the last lines
    are repeated only for a rank whose output the console did not show (``--redirects``,
    ``--local-ranks-filter``). ``where`` (e.g. ``Ray node 10.0.0.5``) is added after the rank;
    ``same`` are the other ranks that failed with the same traceback
    (:meth:`Relay.same_failure`). Nothing is said when the rank's last line on stderr was a
    usage error: it was already said, in one line.
    """
    lines = [ln for ln in rank.tail if ln.strip()]
    errors = [ln for ln in getattr(rank, "err_tail", ()) if ln.strip()]
    last_line = (errors or lines or [""])[-1].strip()
    if last_line.startswith("error: "):
        return
    place = f" ({where})" if where else ""
    head = f"distrun: rank {rank.rank}{place} failed with exit code {code}"
    if not getattr(rank, "hidden", False):
        last = f": {last_line[:200]}" if last_line else ""
        notes = ["its output is above"] if last_line else []
        if same:
            names = ", ".join(map(str, same))
            notes.append(f"rank{'s' if len(same) > 1 else ''} {names} failed the same way")
        sys.stderr.write((f"{head}{last}" + (f" ({'; '.join(notes)})" if notes else "")) + "\n")
        sys.stderr.flush()
        return
    sys.stderr.write(f"{head}; its last lines:\n")
    for ln in lines[-TAIL_LINES:]:
        sys.stderr.write(f"  [rank{rank.rank}] {ln}\n")
    sys.stderr.flush()
