"""Errors distrun raises on purpose; every one carries its own exit code."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["EXIT_REQUEUE", "DistrunError", "UsageError", "closest", "first_line", "suggest"]

#: exit code after a preemption checkpoint: 128+SIGTERM, which schedulers (Kubernetes
#: PyTorchJob's ExitCode policy, SLURM --requeue scripts) treat as retryable
EXIT_REQUEUE = 143


class DistrunError(Exception):
    """An error distrun reports as one line, without a traceback unless --debug."""

    exit_code = 1


class UsageError(DistrunError):
    """The user asked for something wrong (a flag, a file, a name): exit code 2."""

    exit_code = 2


def first_line(exc: BaseException, limit: int = 200) -> str:
    """The first non-blank line of ``exc``'s message (its type name when it has none), for
    one-line reports of errors that carry tracebacks or C++ frames in their text."""
    line = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
    return line[:limit]


def closest(name: str, choices: Iterable[str]) -> str | None:
    """The choice closest to ``name``, or None when none is close."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return close[0] if close else None


def suggest(name: str, choices: Iterable[str]) -> str:
    """Return "; did you mean 'x'?" for the closest choice, or "" when none is close."""
    close = closest(name, choices)
    return f"; did you mean '{close}'?" if close else ""
