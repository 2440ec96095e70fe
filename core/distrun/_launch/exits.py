"""Workers' exits as a launcher sees them: its exit code, and a wait for the next exit. Torch-free."""

from __future__ import annotations

import os
import select
import subprocess
import time
from collections.abc import Sequence

__all__ = ["ExitWatch", "exit_code"]


def exit_code(returncode: int) -> int:
    """``returncode`` itself, or ``128 + N`` for a process ended by signal N (``-N``)."""
    return returncode if returncode >= 0 else 128 - returncode


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
