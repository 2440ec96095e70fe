"""The errors of distrun-safetensors: a checkpoint the user can fix (exit 2), and a fenced commit
(exit 1: the node is stale, and an elastic agent may restart it to rejoin the run)."""

from __future__ import annotations

from distrun.plugin import DistrunError, UsageError

__all__ = ["CheckpointError", "FencedError", "NewerFormatError"]


class CheckpointError(UsageError):
    """A checkpoint is missing, torn, corrupted or does not fit the model (exit code 2)."""


class NewerFormatError(CheckpointError):
    """A checkpoint written by a newer distrun-safetensors than this one.

    It is not damaged: ``--resume latest|auto`` stop on it instead of falling back to an older
    checkpoint (which would train from an older step and, by pruning, could remove it).
    """


class FencedError(DistrunError):
    """A commit refused because a newer start of the run took over the checkpoint folder
    (``fenced: round G' has committed step S; this node's round G is stale ...``)."""
