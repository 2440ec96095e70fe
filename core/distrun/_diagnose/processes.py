"""What the kernel says of a rank: its state, and whether its processes are working.

A stalled run's ranks wait: in a collective, a sleep, a read nobody answers, or stopped. They
use no CPU and move no data. A run whose ranks do not move (no step, no phase, no collective)
but work (a long checkpoint save on rank 0 while the others wait for it, a long computation
between two collectives) is slow, not stalled: the watcher names a stall only once no rank's
processes (the rank and what it started, its session: DataLoader workers included) used CPU
or moved data for a moment. A rank that spins forever (a livelock) looks like work: the
collective timeout ends that run. A library thread that polls by design while the rank waits
(:data:`SPINNERS`: TensorPipe's shared-memory reactor under ``--strategy rpc`` takes ~0.4 of a
core) is not counted. Torch-free; Linux ``/proc``.
"""

from __future__ import annotations

import os
import time

__all__ = ["busy_sessions", "process_state"]

#: a rank works when its session used this share of one CPU, or moved this many bytes ...
BUSY_CPU = 0.1
BUSY_BYTES = 1 << 20
#: ... or when one of its threads ran or waited in a run queue to run for this share of the
#: time: on a machine whose every core is taken a thread that computes gets a share of one,
#: which can fall under BUSY_CPU, but it asks for all of it (a CI run with a busy process per
#: core took a rank that spun for one that waited, and called the run stalled). Each
#: thread on its own: a waiting rank's many threads each wake for a moment, and there each
#: wake-up waits for a CPU too
BUSY_THREAD = 0.5
#: the names of threads that use CPU while their process waits (they poll, by design)
SPINNERS = frozenset({"TP_SHM_reactor"})


def process_state(pid: int) -> str:
    """``running``, ``stopped`` (SIGSTOP, or a debugger's), ``zombie`` or ``gone``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read().decode(errors="replace")
    except OSError:
        return "gone"
    state = stat[stat.rfind(")") + 2:][:1]
    return {"T": "stopped", "t": "stopped", "Z": "zombie", "X": "gone"}.get(state, "running")


def _usage(sessions: set[int]) -> dict[int, tuple[float, int, dict[str, int]]]:
    """Per session: its processes' CPU seconds and bytes read and written so far, and per
    thread (``pid/tid``) the nanoseconds it ran or waited to run (:func:`_threads`)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out: dict[int, tuple[float, int, dict[str, int]]] = {s: (0.0, 0, {}) for s in sessions}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                fields = fh.read().decode(errors="replace").rsplit(")", 1)[1].split()
            sid = int(fields[3])  # (after the state: ppid, pgrp, session)
            if sid not in out:
                continue
            spun, wanted = _threads(name)
            cpu = (int(fields[11]) + int(fields[12]) - spun) / tick  # utime, stime
            moved = 0
            try:
                with open(f"/proc/{name}/io") as fh:
                    io = dict(line.split(":") for line in fh.read().splitlines() if ":" in line)
                moved = int(io.get("rchar", 0)) + int(io.get("wchar", 0))
            except (OSError, ValueError):
                pass
        except (OSError, ValueError, IndexError):
            continue
        was = out[sid]
        out[sid] = (was[0] + cpu, was[1] + moved, {**was[2], **wanted})
    return out


def _threads(pid: str) -> tuple[int, dict[str, int]]:
    """One walk over the threads of process ``pid``: the clock ticks its :data:`SPINNERS`
    used so far, and per other thread (``pid/tid``) the nanoseconds it ran on a CPU or waited
    in a run queue for one so far (the kernel's ``schedstat``; none where the kernel keeps
    none)."""
    spun, wanted = 0, {}
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0, {}
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as fh:
                stat = fh.read().decode(errors="replace")
            if stat[stat.find("(") + 1:stat.rfind(")")] in SPINNERS:
                fields = stat.rsplit(")", 1)[1].split()
                spun += int(fields[11]) + int(fields[12])
                continue
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as fh:
                ran, waited = fh.read().split()[:2]
        except (OSError, ValueError, IndexError):
            continue
        wanted[f"{pid}/{tid}"] = int(ran) + int(waited)
    return spun, wanted


def busy_sessions(sessions: set[int], window: float = 1.5) -> set[int]:
    """The sessions (a rank's pid is its session's id) that worked during ``window`` s."""
    before = _usage(sessions)
    time.sleep(window)
    after = _usage(sessions)
    return {s for s in sessions
            if after[s][0] - before[s][0] >= BUSY_CPU * window
            or after[s][1] - before[s][1] >= BUSY_BYTES
            or max((ns - before[s][2].get(t, ns) for t, ns in after[s][2].items()),
                   default=0) >= BUSY_THREAD * window * 1e9}
