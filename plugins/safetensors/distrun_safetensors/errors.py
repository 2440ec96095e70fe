"""The errors of distrun-safetensors (both exit with code 2: the user can fix them)."""

from __future__ import annotations

from distrun.spec.errors import UsageError

__all__ = ["CheckpointError", "NewerFormatError"]


class CheckpointError(UsageError):
    """A checkpoint is missing, torn, corrupted or does not fit the model (exit code 2)."""


class NewerFormatError(CheckpointError):
    """A checkpoint written by a newer distrun-safetensors than this one.

    It is not damaged: ``--resume latest|auto`` stop on it instead of falling back to an older
    checkpoint (which would train from an older step and, by pruning, could remove it).
    """
