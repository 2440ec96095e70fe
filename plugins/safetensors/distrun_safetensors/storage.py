"""Whether every node of a run sees one checkpoint folder (a shared filesystem) or its own.

A checkpoint is written by every rank and committed by rank 0, so it is whole only in a
folder every node writes to. On per-host disks each node would hold its own ranks' files, and a
lost host takes its shards with it. At the start of a multi-node fit (before a resume reads
anything) the first rank of each node writes a marker file with a random name into the
checkpoint folder; the ranks exchange the names with one all-gather, each looks for every
node's marker, a second all-gather shares what was missing, then each node removes its own.
Markers are opened, not just looked up: an NFS client revalidates a file it opens.
"""

from __future__ import annotations

import contextlib
import os
import socket
import uuid
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

__all__ = ["MARKER_PREFIX", "Unshared", "node_count", "probe"]

#: the marker one node writes into the checkpoint folder while the check runs
MARKER_PREFIX = ".node-"


@dataclass(frozen=True)
class Unshared:
    """Two nodes that do not see the same checkpoint folder."""

    node: int
    host: str
    other: int
    other_host: str

    def describe(self) -> str:
        return (f"node {self.node} (host {self.host}) does not see the files node "
                f"{self.other} (host {self.other_host}) writes there")


def node_count() -> int:
    """The number of nodes of this run (torchrun's ``GROUP_WORLD_SIZE``, else 1); 1 without a
    process group (nothing to compare with)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    try:
        return max(1, int(os.environ.get("GROUP_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _sees(directory: str, name: str, token: str) -> bool:
    path = os.path.join(directory, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        return os.read(fd, 64).decode(errors="replace") == token
    finally:
        os.close(fd)


def probe(directory: str) -> Unshared | None:
    """Whether the nodes share ``directory`` (every rank calls this together): None when they
    do, else one pair of nodes that do not."""
    node = int(os.environ.get("GROUP_RANK", "0"))
    host = socket.gethostname()
    mine: tuple[str, str] | None = None
    error = None
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        token = uuid.uuid4().hex
        mine = (f"{MARKER_PREFIX}{node}-{token[:16]}", token)
        try:
            os.makedirs(directory, exist_ok=True)
            fd = os.open(os.path.join(directory, mine[0]),
                         os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o644)
            try:
                os.write(fd, token.encode())
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            error = f"node {node} (host {host}) cannot write into {directory} ({exc.strerror})"
            mine = None
    try:
        world = dist.get_world_size()
        markers: list[Any] = [None] * world
        dist.all_gather_object(markers, (node, host, mine, error))
        missing = None
        for other, other_host, marker, _ in markers:
            if marker is not None and other != node and not _sees(directory, *marker):
                missing = Unshared(node, host, other, other_host)
                break
        verdicts: list[Any] = [None] * world
        dist.all_gather_object(verdicts, missing)
    finally:
        if mine is not None:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, mine[0]))
    failed = next((e for *_, e in markers if e), None)
    if failed:
        from distrun_safetensors.errors import CheckpointError

        raise CheckpointError(failed)
    return next((v for v in verdicts if v is not None), None)
