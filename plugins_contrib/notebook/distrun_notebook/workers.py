"""The launcher's side: fork the ranks, relay their output, watch them, stop them, reap them.

Everything happens on the calling (kernel) thread: one ``select`` loop reads every rank's
stdout, stderr and report pipes and notices exits, so output reaches the cell while the ranks
run. Ctrl-C (the kernel's interrupt, a SIGINT) is counted by a handler of the launch's own and
acted on in that loop, never raised halfway through a fork. Each rank leads its own process
group: stopping a rank stops what it started (DataLoader workers, subprocesses) too.
"""

from __future__ import annotations

import codecs
import collections
import os
import pickle
import select
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from distrun_notebook.child import HEADER, run_child

__all__ = ["LaunchFailed", "ForkedRanks"]

#: lines of each rank's stderr kept for the error of a rank that ends without a traceback
_TAIL = 20
#: seconds the other ranks get after a failure before SIGKILL: the run is lost anyway (no
#: checkpoint can be agreed with a dead rank), they only get to print their last lines
FAILURE_GRACE = 3.0


class LaunchFailed(RuntimeError):
    """A launched rank failed; the message names it and carries its traceback or last lines.

    ``rank``: the rank that failed first; ``exitcode``: its exit code (negative: killed by that
    signal); ``child_traceback``: its traceback text ("" when it ended without one).
    """

    def __init__(self, message: str, rank: int, exitcode: int | None,
                 child_traceback: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.child_traceback = child_traceback


@dataclass
class _Rank:
    rank: int
    pid: int
    fds: dict[int, str]  # open read end -> "out", "err" or "report"
    report_buf: bytearray = field(default_factory=bytearray)
    report: tuple[Any, ...] | None = None
    exitcode: int | None = None
    reaped: bool = False
    failed_at: int | None = None  # order in which failures were noticed
    decoders: dict[str, Any] = field(default_factory=dict)
    partial: dict[str, str] = field(default_factory=dict)
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=_TAIL))


class ForkedRanks:
    """The forked ranks of one launch: ``run()`` returns rank 0's value or raises.

    Each rank is a fork of the kernel that runs a function, which no command line can start:
    this is why the notebook does not start its ranks in :class:`distrun.plugin.WorkerGroup`
    (it takes their environment from :class:`distrun.plugin.NodeRanks`)."""

    def __init__(self, stop_grace: float, show_all: bool = False,
                 private_fds: Mapping[int, Sequence[int]] | None = None) -> None:
        """``private_fds``: by rank, descriptors only that rank keeps (the others close them)."""
        self.stop_grace = stop_grace
        self.show_all = show_all
        self.private_fds = dict(private_fds or {})
        self.ranks: list[_Rank] = []
        self.interrupts = 0  # Ctrl-Cs received while the ranks ran
        self._kill_at: float | None = None
        self._failures = 0
        #: failures noticed before the others were stopped: the causes, not the consequences
        self._first_wave = 0
        self._stopping = False

    def run(self, targets: Sequence[Callable[[], Any]],
            envs: Sequence[Mapping[str, str]]) -> Any:
        """Fork, relay output until every rank ended; rank 0's value, LaunchFailed or ^C."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()  # or the kernel's pending text would also sit in each copy
            except Exception:
                pass
        previous = self._take_sigint()
        try:
            for rank, (target, env) in enumerate(zip(targets, envs)):
                if self.interrupts:
                    break  # Ctrl-C while starting: start no more
                self._fork(rank, target, env)
            self._loop()
        finally:
            try:
                self._cleanup()  # whatever happened, no process of this launch survives
            finally:
                if previous is not None:
                    signal.signal(signal.SIGINT, previous)
        if self.interrupts:
            raise KeyboardInterrupt
        return self._outcome()

    def _take_sigint(self) -> Any:
        """Count Ctrl-C instead of raising KeyboardInterrupt wherever the launcher happens to
        be (between a fork and its bookkeeping, say); the loop acts on the count. Only the
        main thread can set handlers, and only it receives KeyboardInterrupt anyway."""
        if threading.current_thread() is not threading.main_thread():
            return None

        def on_sigint(signum: int, frame: Any) -> None:
            self.interrupts += 1

        return signal.signal(signal.SIGINT, on_sigint)

    def _fork(self, rank: int, target: Callable[[], Any], env: Mapping[str, str]) -> None:
        pipes = [os.pipe() for _ in range(3)]
        parent_ends = [fd for r in self.ranks for fd in r.fds] + [r for r, _ in pipes] + \
            [fd for owner, fds in self.private_fds.items() if owner != rank for fd in fds]
        fds = dict(zip((r for r, _ in pipes), ("out", "err", "report")))
        seen = self.interrupts
        with warnings.catch_warnings():
            # Python 3.12+ warns that forking a threaded process (a kernel is one) is risky;
            # the child touches none of the kernel's threads' state (see child.py).
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            try:
                (_, out_w), (_, err_w), (_, rep_w) = pipes
                # a SIGINT before the child has its own handler was counted in its copy of
                # this object: the child acts on it once it can
                run_child(rank, env, out_w, err_w, rep_w, parent_ends, target,
                          interrupted=lambda: self.interrupts > seen)
            finally:
                os._exit(1)  # never back into the kernel's code
        self.ranks.append(_Rank(rank, pid, fds))
        try:
            os.setpgid(pid, pid)  # also here: no window where a signal to the group misses it
        except OSError:
            pass
        for r, w in pipes:
            os.close(w)
            os.set_blocking(r, False)

    # -- waiting ------------------------------------------------------------------------------
    def _loop(self) -> None:
        handled = 0
        while not all(r.reaped for r in self.ranks):
            if self.interrupts > handled:
                handled = self.interrupts
                self._stopping = True
                if handled == 1:  # as Ctrl-C in a terminal: a Task saves at its next step
                    self._stop(signal.SIGINT, self.stop_grace)
                else:  # a second one: now
                    self._signal(signal.SIGKILL)
            fds = [fd for r in self.ranks for fd in r.fds]
            if fds:
                for fd in select.select(fds, [], [], 0.1)[0]:
                    self._read(fd)
            else:
                time.sleep(0.05)
            self._reap()
            if not self._stopping and self._failures:
                self._stopping = True
                self._first_wave = self._failures
                self._stop(signal.SIGTERM, min(self.stop_grace, FAILURE_GRACE))  # as torchrun
            if self._kill_at is not None and time.monotonic() >= self._kill_at:
                self._signal(signal.SIGKILL)
                self._kill_at = None

    def _owner(self, fd: int) -> _Rank:
        return next(r for r in self.ranks if fd in r.fds)

    def _read(self, fd: int, chunks: int = 16) -> None:
        """Read what ``fd`` has, up to ``chunks`` x 64 KiB: a rank printing without pause
        must not keep the loop from the others and from noticing exits."""
        r = self._owner(fd)
        kind = r.fds[fd]
        for _ in range(chunks):
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                return
            if not data:
                os.close(fd)
                del r.fds[fd]
                return
            if kind == "report":
                r.report_buf += data
                self._parse_report(r)
            else:
                self._relay(r, kind, data)

    def _parse_report(self, r: _Rank) -> None:
        if r.report is not None or len(r.report_buf) < HEADER.size:
            return
        (size,) = HEADER.unpack_from(r.report_buf)
        if len(r.report_buf) >= HEADER.size + size:
            r.report = pickle.loads(bytes(r.report_buf[HEADER.size:HEADER.size + size]))
            if r.report[0] != "ok":
                self._failed(r)

    def _failed(self, r: _Rank) -> None:
        if r.failed_at is None:
            self._failures += 1
            r.failed_at = self._failures

    def _reap(self) -> None:
        for r in self.ranks:
            if r.reaped:
                continue
            if hasattr(os, "waitid"):
                # Look without reaping: while the rank is a zombie its group id cannot be
                # reused, so killing what it left behind cannot hit a stranger.
                try:
                    if os.waitid(os.P_PID, r.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                        continue
                except ChildProcessError:
                    pass  # someone else reaped it; waitpid below says so
                _killpg(r.pid, signal.SIGKILL)
            try:
                pid, status = os.waitpid(r.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else: its status is lost
                pid, status = r.pid, None
            if pid == 0:
                continue
            r.exitcode = os.waitstatus_to_exitcode(status) if status is not None else None
            r.reaped = True
            self._drain(r)
            if r.report is None or r.report[0] != "ok" or r.exitcode != 0:
                self._failed(r)

    def _drain(self, r: _Rank) -> None:
        """What an ended rank wrote is in its pipes now; read it without waiting for EOF (a
        process it started may still hold the write ends)."""
        for fd in list(r.fds):
            self._read(fd, chunks=1024)
        for kind in ("out", "err"):
            self._relay(r, kind, b"", final=True)

    # -- output -------------------------------------------------------------------------------
    def _relay(self, r: _Rank, kind: str, data: bytes, final: bool = False) -> None:
        decoder = r.decoders.setdefault(kind, codecs.getincrementaldecoder("utf-8")("replace"))
        text = r.partial.pop(kind, "") + decoder.decode(data, final=final)
        if not text:
            return
        lines = text.split("\n")
        if kind == "err":
            r.tail.extend(line for line in lines[:-1] if line.strip())
            if final and lines[-1].strip():
                r.tail.append(lines[-1])
        shown = r.rank == 0 or kind == "err" or self.show_all
        if not shown:
            return
        dst = sys.stdout if kind == "out" else sys.stderr
        if r.rank == 0:  # as it comes: progress bars redraw with "\r"
            dst.write(text)
            return
        complete, rest = lines[:-1], lines[-1]
        if final and rest:
            complete, rest = lines, ""
        if rest:
            r.partial[kind] = rest
        if complete:
            dst.write("".join(f"[rank {r.rank}] {line}\n" for line in complete))

    # -- stopping -----------------------------------------------------------------------------
    def _stop(self, signum: int, grace: float) -> None:
        self._signal(signum)
        self._kill_at = time.monotonic() + grace

    def _signal(self, signum: int) -> None:
        for r in self.ranks:
            # a rank that already reported is ending by itself: only SIGKILL is for it
            if not r.reaped and (r.report is None or signum == signal.SIGKILL):
                _killpg(r.pid, signum)

    def _cleanup(self) -> None:
        """No process of this launch survives it: kill, reap, close."""
        for r in self.ranks:
            if not r.reaped:
                _killpg(r.pid, signal.SIGKILL)
                try:
                    os.kill(r.pid, signal.SIGKILL)  # in case it never got its own group
                except ProcessLookupError:
                    pass
                try:
                    _, status = os.waitpid(r.pid, 0)
                    r.exitcode = os.waitstatus_to_exitcode(status)
                except ChildProcessError:
                    pass
                r.reaped = True
                self._drain(r)
            for fd in list(r.fds):
                os.close(fd)
                del r.fds[fd]
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass

    # -- the result ---------------------------------------------------------------------------
    def _outcome(self) -> Any:
        failed = [r for r in self.ranks if r.failed_at is not None]
        if failed:
            # A rank that raised before the others were stopped is the cause; errors of ranks
            # stopped because of it come after.
            causes = [r for r in failed if (r.failed_at or 0) <= self._first_wave] or failed
            first = min(causes, key=lambda r: (r.report is None or r.report[0] != "error",
                                               r.failed_at))
            also = [r for r in causes if r is not first and r.report and r.report[0] == "error"]
            raise LaunchFailed(_message(first, also), first.rank, first.exitcode,
                               first.report[2] if first.report and first.report[0] == "error"
                               else "") from None
        payload = self.ranks[0].report[1] if self.ranks[0].report else None
        if payload is None:
            return None
        try:
            return pickle.loads(payload)
        except Exception as exc:
            raise LaunchFailed(f"rank 0's return value cannot be unpickled in this process: "
                               f"{type(exc).__name__}: {exc}", 0, 0, "") from None


def _killpg(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "ended (exit status unknown)"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _message(r: _Rank, also: Sequence[_Rank]) -> str:
    report = r.report
    if report is not None and report[0] == "error":
        text = f"rank {r.rank} failed: {report[1]}\n\n{report[2]}"
    else:
        last = r.tail[-1].strip() if r.tail else ""
        how = _describe_exit(report[1] if report is not None and report[0] == "exit"
                             else r.exitcode)
        if report is None and r.exitcode == 0:
            how = "exited without reporting a result (os._exit?)"
        text = f"rank {r.rank} {how}" + (f": {last}" if last else "")
        if len(r.tail) > 1:
            text += "\n\nits last lines on stderr:\n" + "\n".join(r.tail)
    if also:
        text += "\n\n" + "\n".join(f"(rank {o.rank} also failed: {o.report[1]})"  # type: ignore[index]
                                   for o in sorted(also, key=lambda o: o.rank))
    return text
