"""Why a launcher stops its ranks, when the reason is that one of them failed. Torch-free.

A SIGTERM alone asks distrun's loop for a graceful stop: finish the step, agree with the
other ranks, save, exit for requeue (a preemption, a user's stop). After a rank's failure
that stop cannot happen: the step needs the failed rank, so a survivor computes the rest of
its forward and backward only to fail in its next collective, and a restart waits for it
(0.3-0.5 s of a 100M-parameter model's recovery on the CPU). So before it signals the
others, a launcher that stops them because a rank failed writes a note into the group's
folder (:attr:`distrun._launch.group.WorkerGroup.positions`, which every rank knows): the
failed rank and its exit code. A rank's SIGTERM handler reads it (one small file) and ends
its step at once, through its usual error path (teardown and loggers included).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass

from distrun._diagnose.position import POSITIONS_ENV

__all__ = ["FailureNote", "read_note", "write_note"]

#: the note's file name in the group's folder
NOTE = "a-rank-failed"


@dataclass(frozen=True)
class FailureNote:
    """The failed rank and its exit code (the shell's: 128 + N for signal N)."""

    rank: int
    code: int


def write_note(folder: str, rank: int, code: int) -> None:
    """Note in ``folder`` that ``rank`` failed with exit ``code``; whole or not at all."""
    tmp = os.path.join(folder, f".{NOTE}.{os.getpid()}")
    with contextlib.suppress(OSError):  # no note: the ranks stop the graceful way
        with open(tmp, "w") as fh:
            fh.write(f"{rank} {code}\n")
        os.replace(tmp, os.path.join(folder, NOTE))


def read_note(environ: Mapping[str, str] = os.environ) -> FailureNote | None:
    """The note this rank's launcher left before stopping it (None: it left none)."""
    folder = environ.get(POSITIONS_ENV)
    if not folder:
        return None
    try:
        with open(os.path.join(folder, NOTE)) as fh:
            rank, code = fh.read().split()
        return FailureNote(int(rank), int(code))
    except (OSError, ValueError):
        return None
