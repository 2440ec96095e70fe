"""Workers' exits as a launcher sees them: its exit code, and a wait for the next exit. Torch-free."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from collections.abc import Sequence

from distrun._spec.errors import EXIT_REQUEUE

__all__ = ["ExitWatch", "exit_code", "exiting_code", "signal_note"]


def exit_code(returncode: int) -> int:
    """``returncode`` itself, or ``128 + N`` for a process ended by signal N (``-N``)."""
    return returncode if returncode >= 0 else 128 - returncode


#: /proc/<pid>/stat's flags bit of a process that has begun to exit (the kernel's PF_EXITING)
_PF_EXITING = 0x4


def exiting_code(pid: int) -> int | None:
    """The return code of child ``pid`` (``-N``: signal N) once it has begun to exit with a
    failure, before it can be reaped; None while it runs, and for an exit the ranks agreed on
    (0, or :data:`~distrun._spec.errors.EXIT_REQUEUE` after a saved stop).

    A process dies before its exit can be reaped: the kernel first frees its memory, 0.1 s
    for a rank of 1.6 GB here and 0.3 s with the memory tier's 1.2 GB of shared mappings
    besides, and a launcher that waits for the reap learns of a failure that much later. The
    kernel shows the code from the start of the exit (``/proc/<pid>/stat``: the flags, field
    9, and the wait status, field 52). An agreed exit is left to the reap: every rank makes
    that stop at the same step boundary, so an early look gains nothing; 0 is also what the
    field reads in the moment between the flag and the code.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rpartition(b")")[2].split()  # fields[0] is field 3
    except OSError:
        return None
    if len(fields) < 50 or not int(fields[6]) & _PF_EXITING:
        return None
    status = int(fields[49])
    if status & 0x7F:
        return -(status & 0x7F)
    code = (status >> 8) & 0xFF
    return None if code in (0, EXIT_REQUEUE) else code


def signal_note(code: int) -> str:
    """`` (killed by SIGKILL)`` for the shell's 128 + N exit codes of a signal's death."""
    if 128 < code < 128 + signal.NSIG:
        try:
            return f" (killed by {signal.Signals(code - 128).name})"
        except ValueError:
            return ""
    return ""


class ExitWatch:
    """Sleep until one of ``procs`` exits: a Linux pidfd per process, else a plain sleep.

    A launcher that polls its workers wakes up many times a second, and on a machine whose
    every core runs a worker each wake-up is taken from one; it also learns of an exit only at
    its next poll. Watching pidfds it sleeps until the kernel says a worker has exited.
    """

    def __init__(self, procs: Sequence[subprocess.Popen]) -> None:
        self.fds: list[int] = []
        self.poller = select.poll() if hasattr(select, "poll") else None
        if self.poller is None or not hasattr(os, "pidfd_open"):
            return
        for proc in procs:
            try:
                fd = os.pidfd_open(proc.pid)
            except OSError:  # no pidfd on this kernel, or the process is already reaped
                self.close()
                return
            self.fds.append(fd)
            self.poller.register(fd, select.POLLIN)

    @property
    def blocking(self) -> bool:
        """True when :meth:`wait` returns as soon as a process exits."""
        return bool(self.fds)

    def wait(self, timeout: float) -> None:
        """Return when a process has exited (its pidfd is readable) or after ``timeout``."""
        if not self.fds or self.poller is None:
            time.sleep(timeout)
            return
        for fd, _ in self.poller.poll(timeout * 1000.0):
            # an exited process's pidfd stays readable: watch only the ones still running
            self.poller.unregister(fd)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
