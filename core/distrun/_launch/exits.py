"""Workers' exits as a launcher sees them: its exit code, and a wait for the next exit. Torch-free."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from collections.abc import Sequence

from distrun._spec.errors import EXIT_REQUEUE

__all__ = ["DEVICE_FILES", "ExitWatch", "exit_code", "exiting_code", "has_begun_exit",
           "holds_device", "signal_note"]


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
    fields = _stat(f"/proc/{pid}/stat")
    if fields is None or len(fields) < 50 or not int(fields[6]) & _PF_EXITING:
        return None
    status = int(fields[49])
    if status & 0x7F:
        return -(status & 0x7F)
    code = (status >> 8) & 0xFF
    return None if code in (0, EXIT_REQUEUE) else code


def _stat(path: str) -> list[bytes] | None:
    """The fields of a ``/proc/.../stat`` file from field 3 on (after the command's name,
    which may hold spaces); None: it is gone."""
    try:
        with open(path, "rb") as fh:
            return fh.read().rpartition(b")")[2].split()
    except OSError:
        return None


def has_begun_exit(pid: int) -> bool:
    """True once every thread of child ``pid`` has begun to exit (or it is gone): none can run
    the program again, whatever the kernel still has to free before the exit can be reaped.

    Every thread is looked at, not only the first: a main thread that ends by itself leaves
    the others running (only an exit of the whole process ends them all)."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for tid in threads:
        fields = _stat(f"/proc/{pid}/task/{tid}/stat")
        if fields is not None and len(fields) > 6 and not int(fields[6]) & _PF_EXITING:
            return False
    return True


#: where a device's memory is mapped from: NVIDIA's and AMD's GPUs, DRM render nodes, the
#: kernel's accelerators, AWS Neuron and Ascend devices
DEVICE_FILES = ("/dev/nvidia", "/dev/kfd", "/dev/dri/", "/dev/accel/", "/dev/neuron",
                "/dev/davinci")


def holds_device(pid: int, devices: Sequence[str] = DEVICE_FILES) -> bool:
    """Whether process ``pid`` has one of ``devices`` open (a prefix of the file's path).

    The driver frees what a process holds on its device (a GPU's memory) when the file is
    closed, late in the process's exit, after its memory: a new worker on that device starts
    only once the old one's exit is complete."""
    folder = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(folder)
    except OSError:
        return False
    for fd in fds:
        try:
            target = os.readlink(os.path.join(folder, fd))
        except OSError:
            continue
        if target.startswith(tuple(devices)):
            return True
    return False


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
