"""A worker's return code as the launcher's exit code, the way a shell reports it. Torch-free."""

from __future__ import annotations

__all__ = ["exit_code"]


def exit_code(returncode: int) -> int:
    """``returncode`` itself, or ``128 + N`` for a process ended by signal N (``-N``)."""
    return returncode if returncode >= 0 else 128 - returncode
