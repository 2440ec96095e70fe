"""Errors distrun raises on purpose; every one carries its own exit code."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["DistrunError", "UsageError", "suggest"]


class DistrunError(Exception):
    """An error distrun reports as one line, without a traceback unless --debug."""

    exit_code = 1


class UsageError(DistrunError):
    """The user asked for something wrong (a flag, a file, a name): exit code 2."""

    exit_code = 2


def suggest(name: str, choices: Iterable[str]) -> str:
    """Return "; did you mean 'x'?" for the closest choice, or "" when none is close."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""
