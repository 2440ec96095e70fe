"""Workers' output to the launcher's terminal, line by line; every launcher uses this one.

Each line goes to the launcher's stdout or stderr as the worker wrote it (``--tee`` prefixes
``[rankN]: ``), into the rank's log file when it has one, and into the rank's tail: its last
:data:`TAIL_LINES` lines, shown once when the rank fails (its stderr lines are kept apart too:
the failure line quotes the rank's last line on stderr, where its error is, whatever order the
two pipes were read in). An ``error: ...`` line (a usage error) that several ranks print is
said once, and so is a traceback: a Python traceback is printed as one block when complete,
and the same block from another rank is not printed again (the failure line names the ranks
that failed the same way). Everything still goes to each rank's log file.

A carriage return passes through: a line that redraws itself (tqdm's ``\r``-redraws) is shown
as it comes, each state as soon as it is written, so a progress bar redraws in place as it
does under torchrun; every other line goes out whole, so two ranks' lines never mix. A log file that cannot be written (a full disk) is given up with one warning:
the terminal keeps the output and the workers are never blocked on a pipe. Torch-free.
"""

from __future__ import annotations

import codecs
import collections
import contextlib
import math
import os
import re
import select
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Protocol

from distrun._launch.exits import signal_note

__all__ = ["TAIL_LINES", "LineSink", "PipeReader", "RankLines", "RankOutput", "Relay", "SinkRelay",
           "new_tail", "report_failure"]

#: lines of a rank kept for its failure report
TAIL_LINES = 20


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
_CHUNK = 1 << 16
#: the end of a line, or of a redraw (a carriage return not part of a \r\n)
_PIECE_END = re.compile(r"\n|\r(?=[^\n])")
_RANK_PREFIX = re.compile(r"^\[(?:rank|default)?\d+\]:\s?")


def _plain(line: str) -> str:
    """``line`` without torch's ``[rankN]:`` prefix (its excepthook puts one on each line)."""
    return _RANK_PREFIX.sub("", line, count=1)


#: where a worker group's output goes instead of the console: ``sink(stream, text)``, stream
#: ``"out"`` or ``"err"``, text any piece of the output as it comes (a ``\r`` redraw too)
LineSink = Callable[[str, str], None]


class Relay:
    """Print the output of many ranks without mixing their lines; thread-safe.

    Each (rank, stream) is fed by one thread at a time (:meth:`pipe`, or a
    launcher's own reader calling :meth:`emit`). A launcher whose ranks run elsewhere (Ray's
    actors, a cluster's log stream) feeds it with :meth:`emit` and :meth:`flush`, and says a
    failed rank with :meth:`report`.
    """

    def __init__(self, tee: bool = False,
                 show: Callable[[int, IO[str]], bool] | None = None) -> None:
        self.tee = tee
        #: whether a line of rank N bound for ``dst`` reaches the console (torchrun's
        #: ``--redirects`` and ``--local-ranks-filter``); it goes to the log file regardless
        self.show = show
        #: held while a line is written (and while a rank's log file is closed)
        self.lock = threading.Lock()
        self._seen_errors: set[str] = set()
        #: the open end of the last line, per (rank, stream), how much of it is shown
        #: (-1: none yet, but it follows a ``\\r`` and is shown as it comes) and how much
        #: of it is in the log file
        self._open: dict[tuple[int, int], tuple[str, int, int]] = {}
        #: a traceback being read, per (rank, stream); printed as one block when complete
        self._pending: dict[tuple[int, int], list[str]] = {}
        #: each traceback printed (its lines without torch's rank prefix) -> the ranks that
        #: printed it, first one first
        self._tracebacks: dict[tuple[str, ...], list[int]] = {}
        #: the last traceback of each rank
        self._last_traceback: dict[int, tuple[str, ...]] = {}
        self._log_warned = False
        #: when each (rank, stream) piped by :meth:`pipe` reached its end
        self._ended: dict[tuple[int, int], float] = {}
        #: when each rank's first traceback was complete
        self._first_traceback: dict[int, float] = {}

    def emit(self, rank: RankLines, text: str, dst: IO[str]) -> None:
        """Relay output of ``rank`` bound for ``dst``: a line, several, or any part of one.

        Whole lines go out whole (two ranks' lines never mix). A line that redraws itself
        (``\\r``: a progress bar) is shown as it comes, each state as soon as it is written.
        """
        key = (rank.rank, id(dst))
        buf, shown, logged = self._open.pop(key, ("", 0, 0))
        buf += text
        start = 0
        for end in _line_ends(buf):
            self._piece(rank, buf[start:end], dst, shown)
            start, shown = end, 0
        rest = buf[start:]
        # The log file gets whole pieces too: the rank's stdout and stderr are read by two
        # threads, and a line written in two pieces (unbuffered Python writes a print's
        # text and its newline apart) must not be cut by the other stream's line.
        if len(rest) - logged > _CHUNK:  # a line that never ends: logged as it comes
            self._log(rank, buf[logged:])
            logged = len(rest)
        else:
            self._log(rank, buf[logged:start])
            logged = max(logged - start, 0)
        if not rest:
            return
        if start and buf[start - 1] == "\r" and not shown and key not in self._pending:
            shown = -1  # a redraw's open state: shown as it comes, from here on
        if shown:
            at = max(shown, 0)
            self._console(rank, rest[at:], dst, line_start=at == 0)
            shown = len(rest)
        self._open[key] = (rest, shown, logged)

    def flush(self, rank: RankLines, dst: IO[str]) -> None:
        """The stream of ``rank`` to ``dst`` ended: print what is left (an unfinished
        traceback, a last line without its newline)."""
        key = (rank.rank, id(dst))
        rest, shown, logged = self._open.pop(key, ("", 0, 0))
        self._log(rank, rest[logged:])
        shown = max(shown, 0)
        if rest[shown:]:
            self._console(rank, rest[shown:], dst, line_start=shown == 0)
        with self.lock:
            self._write(rank, self._pending.pop(key, []), dst)

    def say(self, line: str) -> None:
        """A line of the launcher's own (a node service's: the stall watcher's), whole,
        between the ranks' lines."""
        with self.lock:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()

    def report(self, rank: RankLines, code: int, where: str = "",
               same: Sequence[int] = ()) -> None:
        """Say once, in one line, that ``rank`` failed with exit ``code`` (see
        :func:`report_failure`; ``where``: the node it ran on, e.g. ``Ray node 10.0.0.5``)."""
        report_failure(rank, code, where=where, same=same)

    def failed_at(self, rank: int) -> float:
        """When ``rank`` first showed a failure: its first complete traceback, else the end
        of its piped streams (about its exit); ``inf`` when neither is known. The order in
        which ranks failed, which one poll of their exit codes cannot tell: a rank that loses
        its peer reports it after the peer's own error (and a dying rank's exit handlers can
        outlast its peer's report)."""
        ends = [t for (r, _), t in self._ended.items() if r == rank]
        ended = max(ends) if len(ends) >= 2 else math.inf
        return min(self._first_traceback.get(rank, math.inf), ended)

    def same_failure(self, rank: int) -> list[int]:
        """The other ranks whose last traceback was the same as ``rank``'s (not printed
        again), in rank order."""
        with self.lock:
            block = self._last_traceback.get(rank)
            return sorted(r for r, b in self._last_traceback.items() if b == block and r != rank) \
                if block is not None else []

    def _log(self, rank: RankLines, text: str) -> None:
        """Append ``text`` to the rank's log file; one that fails (a full disk) is given up,
        said once for the run: the console keeps the output."""
        if not text:
            return
        with self.lock:
            log = rank.log
            if log is None or log.closed:
                return
            try:
                log.write(text)
                log.flush()
            except (OSError, ValueError) as exc:
                rank.log = None
                with contextlib.suppress(OSError, ValueError):
                    log.close()
                if not self._log_warned:
                    self._log_warned = True
                    why = os.strerror(exc.errno) if isinstance(exc, OSError) and exc.errno \
                        else str(exc)
                    name = getattr(log, "name", "its log file")
                    sys.stderr.write(f"warning: cannot write {name} ({why}): the workers' "
                                     "output goes on to the terminal only\n")
                    sys.stderr.flush()

    def _piece(self, rank: RankLines, piece: str, dst: IO[str], shown: int) -> None:
        """One ended piece: a line (``\\n``) or a redraw (``\\r``), its first ``shown``
        characters already on the console."""
        shown = max(shown, 0)
        if not piece.endswith("\n"):  # a redraw: straight through, not a line of the tail
            self._console(rank, piece[shown:], dst, line_start=shown == 0)
            return
        text = piece.rstrip("\r\n").rsplit("\r", 1)[-1]  # what the terminal shows of it
        rank.tail.append(text)
        err_tail = getattr(rank, "err_tail", None)
        if dst is sys.stderr and err_tail is not None:
            err_tail.append(text)
        if shown:  # its start is shown already: it could not be a held line
            self._console(rank, piece[shown:], dst, line_start=False)
            return
        with self.lock:
            if self.show is not None and not self.show(rank.rank, dst):
                setattr(rank, "hidden", True)  # noqa: B010 - its report repeats its lines
                return
            # The same usage error (or warning) from N ranks is said once.
            plain = _plain(piece)
            if plain.startswith(("error: ", "warning: ")):
                if plain in self._seen_errors:
                    return
                self._seen_errors.add(plain)
            self._write(rank, self._traceback_lines(rank, piece, dst), dst)

    def _console(self, rank: RankLines, text: str, dst: IO[str], line_start: bool) -> None:
        if not text:
            return
        with self.lock:
            if self.show is not None and not self.show(rank.rank, dst):
                setattr(rank, "hidden", True)  # noqa: B010 - its report repeats its lines
                return
            dst.write(f"[rank{rank.rank}]: {text}" if self.tee and line_start else text)
            dst.flush()

    def _write(self, rank: RankLines, lines: list[str], dst: IO[str]) -> None:
        if not lines:
            return
        dst.write("".join(f"[rank{rank.rank}]: {ln}" if self.tee else ln for ln in lines))
        dst.flush()

    def _traceback_lines(self, rank: RankLines, line: str, dst: IO[str]) -> list[str]:
        """The lines to print now for ``line``: a traceback waits until its last line, then
        is printed whole, or not at all when another rank printed the same block (torch's
        ``[rankN]:`` prefixes aside)."""
        key = (rank.rank, id(dst))
        block = self._pending.get(key)
        plain = _plain(line)
        if block is None:
            if plain.rstrip("\n") != _TRACEBACK:
                return [line]
            self._pending[key] = [line]
            return []
        block.append(line)
        if plain[:1] in (" ", "\t"):
            return []  # a frame: the block goes on
        del self._pending[key]  # the exception's line ends it
        self._first_traceback.setdefault(rank.rank, time.monotonic())
        text = tuple(_plain(ln) for ln in block)
        self._last_traceback[rank.rank] = text
        ranks = self._tracebacks.setdefault(text, [])
        first = not ranks or ranks == [rank.rank]
        if rank.rank not in ranks:
            ranks.append(rank.rank)
        return block if first else []

    def pipe(self, rank: RankLines, src: IO[bytes], dst: IO[str]) -> PipeReader:
        """Relay everything the pipe ``src`` (bytes) carries in a daemon thread, as it
        comes, until it closes. The pipe is always drained: a worker never blocks on it."""
        thread = PipeReader(self, rank, src, dst)
        thread.start()
        return thread

    def _guarded(self, rank: RankLines, text: str | None, dst: IO[str]) -> None:
        """:meth:`emit` (``None``: :meth:`flush`) for a reader thread, which must go on
        draining its pipe whatever the console does (a closed terminal, ``| head``)."""
        try:
            if text is None:
                self.flush(rank, dst)
            elif text:
                self.emit(rank, text, dst)
        except Exception:  # noqa: BLE001 - the output is lost; the worker must not block
            pass


class PipeReader(threading.Thread):
    """The daemon thread that relays one pipe of a worker (:meth:`Relay.pipe`).

    :meth:`drained` says whether all the worker wrote so far has been relayed, before the
    pipe closes: a process's pipes close late in its exit, after the kernel has freed its
    memory, and a launcher that goes on once a worker has begun to exit still says its own
    next line after the worker's last ones."""

    def __init__(self, relay: Relay, rank: RankLines, src: IO[bytes], dst: IO[str]) -> None:
        super().__init__(daemon=True)
        self._relay, self._rank, self._src, self._dst = relay, rank, src, dst
        #: held from each read until what it read has been relayed
        self._busy = threading.Lock()

    def run(self) -> None:
        relay, rank, src, dst = self._relay, self._rank, self._src, self._dst
        read = getattr(src, "read1", src.read)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        while True:
            _wait_readable(src)  # (not holding the lock: a worker may write nothing for hours)
            with self._busy:
                chunk = read(_CHUNK)
                relay._guarded(rank, decoder.decode(chunk, final=not chunk), dst)
            if not chunk:
                break
        relay._ended[(rank.rank, id(dst))] = time.monotonic()
        relay._guarded(rank, None, dst)
        src.close()

    def drained(self, timeout: float) -> bool:
        """True when nothing written to the pipe so far is left to relay; False when that is
        not known within ``timeout`` seconds (a relay held up by a slow console)."""
        if not self._busy.acquire(timeout=max(0.0, timeout)):
            return False
        try:  # data in the pipe is read by the next turn of the loop, once this lock is free
            return not self.is_alive() or not _readable_now(self._src)
        finally:
            self._busy.release()


def _wait_readable(src: IO[bytes]) -> None:
    """Wait until ``src`` has data or is closed at the other end (at once where it is not a
    file descriptor: its read then waits)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        poller = select.poll()
        poller.register(src.fileno(), select.POLLIN)
        poller.poll()


def _readable_now(src: IO[bytes]) -> bool:
    """Whether ``src`` has data to read now (False where it is not a file descriptor)."""
    try:
        poller = select.poll()
        poller.register(src.fileno(), select.POLLIN)
        return any(event & select.POLLIN for _, event in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


class SinkRelay(Relay):
    """A relay that hands each piece of output to a :data:`LineSink` instead of printing it
    (a launcher that forwards its workers' output elsewhere: the Ray actor to its driver)."""

    def __init__(self, sink: LineSink) -> None:
        super().__init__()
        self.sink = sink

    def emit(self, rank: RankLines, text: str, dst: IO[str]) -> None:
        self.sink("out" if dst is sys.stdout else "err", text)

    def flush(self, rank: RankLines, dst: IO[str]) -> None:
        """Nothing is held back: each piece went on as it came."""

    def say(self, line: str) -> None:
        """The launcher's own line goes on as ``say``."""
        self.sink("say", line + "\n")


def _line_ends(buf: str) -> list[int]:
    """Where the ended pieces of ``buf`` end: after each ``\\n``, and after each ``\\r``
    that is neither the last character (a ``\\n`` may follow) nor followed by ``\\n``."""
    return [m.end() for m in _PIECE_END.finditer(buf)]


def report_failure(rank: RankLines, code: int, where: str = "",
                   same: Sequence[int] = ()) -> None:
    """Say once, in one line, that ``rank`` failed with exit ``code``.

    Its output (a traceback, say) is already on the console, so the line names the rank, the
    signal that killed it, and its last line on stderr (where it wrote nothing, that it printed
    no error: its last line on stdout is named, not quoted as the reason); the last lines
    are repeated only for a rank whose output the console did not show (``--redirects``,
    ``--local-ranks-filter``). ``where`` (e.g. ``Ray node 10.0.0.5``) is added after the rank;
    ``same`` are the other ranks that failed with the same traceback
    (:meth:`Relay.same_failure`). Nothing is said when the rank's last line on stderr was a
    usage error: it was already said, in one line.
    """
    lines = [ln for ln in rank.tail if ln.strip()]
    has_err_tail = hasattr(rank, "err_tail")
    errors = [ln for ln in getattr(rank, "err_tail", ()) if ln.strip()]
    last_line = _plain((errors or lines or [""])[-1]).strip()
    if last_line.startswith("error: "):
        return
    place = f" ({where})" if where else ""
    head = f"distrun: rank {rank.rank}{place} failed with exit code {code}{signal_note(code)}"
    if not getattr(rank, "hidden", False):
        notes = []
        if errors or not has_err_tail:
            last = f": {last_line[:200]}" if last_line else ""
            if last_line:
                notes.append("its output is above")
        else:  # nothing on stderr: its last line is not an error, so it is not quoted as one
            last = " and printed no error"
            if last_line:
                notes.append(f"its last line, above: {last_line[:160]}")
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
