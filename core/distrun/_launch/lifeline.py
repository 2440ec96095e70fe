"""A worker's tie to its launcher: it dies with it, and can tell whether it is still there.

:class:`ProcessId` names one process (its pid and start time) for as long as the machine runs,
and says whether it still runs: this process's launcher, a lock's holder, a segment's creator.

The same tie for any child process: :func:`die_with_parent` (tests tie what they start to
pytest with it), and :mod:`distrun._launch.reaper` for a child whose own children would not
follow it.

The launcher (core, elastic agent) exports its pid as :data:`LAUNCHER_PID_ENV`. At start the
worker asks the kernel for SIGKILL when its parent dies (Linux ``PR_SET_PDEATHSIG``; it fires
when the parent *thread* that forked the worker exits, and every launcher starts its workers
from its main thread), then checks ``getppid()`` to close the race of a launcher that died
before the request. Torch-free.
"""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = ["LAUNCHER_PID_ENV", "ProcessId", "die_with", "die_with_launcher", "die_with_parent",
           "launcher_pid", "launcher_alive", "pid_alive", "pid_start_time"]

LAUNCHER_PID_ENV = "DISTRUN_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1


def launcher_pid(environ: Mapping[str, str] | None = None) -> int | None:
    """The pid of the launcher that started this process (or the process whose environment
    ``environ`` is); None when no distrun launcher did."""
    try:
        return int((os.environ if environ is None else environ)[LAUNCHER_PID_ENV])
    except (KeyError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    """A live process (running or sleeping); a zombie waiting for its reaper counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X", "x")


def pid_start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks after boot; None when there is none).

    With the pid it names one process for as long as the machine runs: a pid is reused once
    its process has ended, its start time with it is not.
    """
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def launcher_alive() -> bool:
    """False once the launcher that started this process is gone (True when there is none)."""
    pid = launcher_pid()
    return pid is None or os.getppid() == pid


@dataclass(frozen=True)
class ProcessId:
    """One process for as long as the machine runs: its pid and its start time.

    A pid is reused once its process has ended; with its start time it names one process.
    ``start`` is the clock ticks after boot at which it started, ``""`` when not known (the pid
    alone then decides), None when the process was already gone when it was named. Its text,
    ``"<pid>.<start>"`` (``0`` for a start not known), is read back by :meth:`parse`.
    """

    pid: int
    start: str | None = ""

    @classmethod
    def of(cls, pid: int) -> ProcessId:
        """Process ``pid`` as it is now (``start`` None when there is none)."""
        return cls(pid, pid_start_time(pid))

    @classmethod
    def launcher(cls, environ: Mapping[str, str] | None = None) -> ProcessId | None:
        """The launcher that started this process (or the process whose environment
        ``environ`` is); None when no distrun launcher did.

        This process's launcher is its parent: once this process has another (it was handed
        on when its launcher ended), the launcher is gone (``start`` None), even when its pid
        now names another process.
        """
        pid = launcher_pid(environ)
        if pid is None:
            return None
        if environ is None and os.getppid() != pid:
            return cls(pid, None)
        return cls.of(pid)

    @classmethod
    def parse(cls, text: str) -> ProcessId | None:
        """The process ``text`` (``"<pid>.<start>"`` or ``"<pid>"``) names; None when it is
        not such a text."""
        pid, _, start = text.partition(".")
        if not pid.isdigit() or not (start == "" or start.isdigit()):
            return None
        return cls(int(pid), "" if start in ("", "0") else start)

    def alive(self) -> bool:
        """Whether this process still runs: a zombie, or another process given its pid since,
        is gone."""
        if self.start is None or not pid_alive(self.pid):
            return False
        return self.start == "" or pid_start_time(self.pid) == self.start

    def __str__(self) -> str:
        return f"{self.pid}.{self.start or 0}"


def _prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: the callers' own checks still apply
        return None


def _ask_for_signal_at_parent_death(signum: int, prctl: Callable[..., int] | None = None
                                    ) -> None:
    prctl = prctl or _prctl()
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)


def die_with_launcher() -> None:
    """Be SIGKILLed when the launcher dies; die now if it already has."""
    pid = launcher_pid()
    if pid is not None:
        die_with(pid)


def die_with(parent: int, signum: int = signal.SIGKILL,
             prctl: Callable[..., int] | None = None) -> None:
    """Get ``signum`` when this process's parent, ``parent``, dies; SIGKILL now if it has."""
    _ask_for_signal_at_parent_death(signum, prctl)
    if os.getppid() != parent:  # it died before the request
        os.kill(os.getpid(), signal.SIGKILL)


def die_with_parent(signum: int = signal.SIGKILL) -> Callable[[], None]:
    """A ``preexec_fn`` that ties a child process to this one: ``signum`` when this dies.

    ``subprocess.Popen(cmd, preexec_fn=die_with_parent())``: however this process ends (kill -9
    included) the child gets ``signum``, SIGKILL unless asked otherwise (the request survives
    exec). Call it from the thread that will outlive the child (the kernel sends the signal when
    the parent *thread* ends): the main thread, in a test. The child's own children are not
    tied by it (:mod:`distrun._launch.reaper` ties a whole tree).
    """
    parent, prctl = os.getpid(), _prctl()  # looked up here: no dlopen between fork and exec

    def tie() -> None:  # in the child, between fork and exec
        die_with(parent, signum, prctl)

    return tie
