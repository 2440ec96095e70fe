"""A worker's tie to its launcher: it dies with it, and can tell whether it is still there.

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

__all__ = ["LAUNCHER_PID_ENV", "die_with_launcher", "launcher_alive", "pid_alive",
           "pid_start_time"]

LAUNCHER_PID_ENV = "DISTRUN_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1


def _launcher_pid() -> int | None:
    try:
        return int(os.environ[LAUNCHER_PID_ENV])
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
    pid = _launcher_pid()
    return pid is None or os.getppid() == pid


def die_with_launcher() -> None:
    """Be SIGKILLed when the launcher dies; die now if it already has."""
    if _launcher_pid() is None:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: launcher_alive() checks still apply
        pass
    if not launcher_alive():
        os.kill(os.getpid(), signal.SIGKILL)
