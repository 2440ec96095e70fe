"""What stays in a checkpoint folder: the ``latest``/``best`` pointers, the monitored value in a
committed manifest, pruning (``keep_last``, the best k) and the leftovers of killed saves
(through :mod:`~distrun_safetensors.leftovers`).

Rank 0 runs all of it, after a commit (see FORMAT.md, commit protocol). Torch-free.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from dataclasses import dataclass
from typing import Any

from distrun_safetensors.fence import STALE_AFTER, CommitLock
from distrun_safetensors.files import durable, fsync_dir, member, write_json
from distrun_safetensors.leftovers import discard, sweep_stale
from distrun_safetensors.manifest import (
    BEST,
    MANIFEST,
    MONITOR,
    RUN,
    monitor_record,
    read_json,
    read_manifest_quietly,
    read_pointer,
    step_folders,
)
from distrun_safetensors.paths import GENERATION_FILE

#: the ``reason`` in the manifest of a checkpoint a callback object wrote
#: (:mod:`~distrun_safetensors.callback`): ``--ckpt-keep-last`` leaves these to their callback
CALLBACK_REASON = "callback"

#: the temporary names a commit, a tag or a draw of the generation writes beside the folders
_TEMPORARIES = (".old-step-", ".latest-", f".{BEST}-", ".manifest-", f"{GENERATION_FILE}-")

__all__ = ["Retention", "add_record", "other_runs", "point_best", "prune", "replace_pointer"]


@dataclass(frozen=True)
class Retention:
    """The best-k bookkeeping a save hands to rank 0's commit and pruning (``--ckpt-monitor``).

    ``best``: the folder name the ``best`` pointer names after this save (None: remove it);
    ``protect``: the top-k folder names, never removed; ``monitor``/``mode``: the metric, so a
    checkpoint saved only for being among the best of it (reason ``best``) is removed once it
    leaves the top k, while those of another metric are left alone.
    """

    best: str | None
    protect: frozenset[str]
    monitor: str
    mode: str


def replace_pointer(directory: str, name: str, target: str) -> None:
    """Atomically make the pointer file ``name`` (``latest``, ``best``) say ``target``."""
    pointer = os.path.join(directory, f".{name}-{uuid.uuid4().hex[:8]}")
    try:
        with open(pointer, "w") as fh:
            fh.write(target + "\n")
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:  # a full disk: the pointer stays as it was, no half-written copy
        with contextlib.suppress(OSError):
            os.unlink(pointer)
        if exc.filename or not exc.strerror:
            raise
        raise OSError(exc.errno, exc.strerror, pointer) from exc
    durable(f"{name} written")
    os.replace(pointer, os.path.join(directory, name))
    fsync_dir(directory)
    durable(f"{name} replaced")


def point_best(directory: str, retention: Retention) -> None:
    """Make ``best`` name the top checkpoint (after ``latest``); no write when it already
    does, removed when there is none."""
    path = os.path.join(directory, BEST)
    named, _ = read_pointer(directory, BEST)
    if retention.best is None:
        if os.path.lexists(path):
            os.unlink(path)
            fsync_dir(directory)
            durable("best removed")
        return
    if named is None or os.path.basename(named) != retention.best:
        replace_pointer(directory, BEST, retention.best)


def add_record(directory: str, folder: str, record: dict[str, Any]) -> None:
    """Put the monitored value into the manifest of the committed ``folder``: the new manifest
    is written beside the step folders, fsynced and renamed over the old one (a crash leaves
    one or the other)."""
    path = member(folder, MANIFEST)
    manifest = read_json(folder, MANIFEST, "manifest")
    manifest[MONITOR] = record
    tmp = os.path.join(directory, f".manifest-{uuid.uuid4().hex[:8]}")
    write_json(tmp, manifest)
    os.replace(tmp, path)
    fsync_dir(folder)
    durable("manifest replaced")


def other_runs(directory: str, key: str) -> list[str]:
    """The committed checkpoints of ``directory`` (newest first) that the run ``key`` did not
    write: another run's, or one written before manifests named their run."""
    out = []
    for folder in step_folders(directory):
        if os.path.basename(folder).startswith("."):
            continue  # a copy moved aside: its step-N says whose it is
        if (read_manifest_quietly(folder) or {}).get(RUN) != key:
            out.append(folder)
    return out


def prune(directory: str, keep: str, keep_last: int, retention: Retention | None = None,
          held: frozenset[str] = frozenset(), released: frozenset[str] = frozenset(),
          stale_after: float = STALE_AFTER, sweep: bool = True) -> None:
    """Drop leftovers of crashed saves, all but the ``keep_last`` newest checkpoints, and
    (with ``retention``) the checkpoints saved for the best k that left the top k.

    ``stale_after``: how long a commit lock left by another host lasts (see
    :mod:`~distrun_safetensors.fence`); the temporaries of commits are removed under it.

    Checkpoint callbacks (:mod:`~distrun_safetensors.callback`): the folders one of them keeps
    (``held``) are never removed; those their writer let go and none keeps (``released``) are;
    a folder a callback wrote (reason ``callback``) is otherwise left to the callbacks.

    ``keep`` (the checkpoint just committed or given a value) always stays. ``keep_last``
    counts the checkpoints saved for any reason but ``best``; the top k (``retention.protect``)
    are never removed; a checkpoint that carries a value of a metric this run does not monitor
    (or any value, in a run without ``--ckpt-monitor``) is left alone. ``sweep``: the
    leftovers of saves that did not finish are removed first.
    """
    if sweep:  # (not in the memory tier's folder: see save.Checkpointer._quiet_start)
        sweep_stale(directory)
    if any(name.startswith(_TEMPORARIES) for name in os.listdir(directory)):
        # every writer of these (a commit, a tag, a draw of the generation) holds the commit
        # lock while they exist: under it, the ones left are a killed writer's, never those of
        # another run still writing to the folder
        with CommitLock(directory, stale_after):
            for name in os.listdir(directory):
                if name.startswith(_TEMPORARIES):
                    path = os.path.join(directory, name)
                    if os.path.isdir(path) and not os.path.islink(path):
                        discard(path)  # a moved-aside checkpoint: readers still take it
                    else:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(path)
    if keep_last <= 0 and retention is None and not released:
        return
    protect = (retention.protect if retention is not None else frozenset()) | held
    regular, drop = [], []
    keep_regular = True
    for folder in step_folders(directory):
        if folder != keep and os.path.basename(folder) in released - protect:
            drop.append(folder)
            continue
        manifest = read_manifest_quietly(folder)
        if (manifest or {}).get("reason") == CALLBACK_REASON:
            keep_regular = keep_regular and folder != keep
            continue  # its callback decides
        record = monitor_record(manifest)
        ours = retention is not None and record is not None \
            and (record["name"], record["mode"]) == (retention.monitor, retention.mode)
        best_only = (manifest or {}).get("reason") == "best"
        if folder == keep:
            keep_regular = not best_only
        elif best_only:
            if ours and os.path.basename(folder) not in protect:
                drop.append(folder)
        elif record is None or ours:
            regular.append(folder)
    if keep_last > 0:
        quota = keep_last - (1 if keep_regular else 0)
        drop += [f for f in regular[quota:] if os.path.basename(f) not in protect]
    for folder in drop:
        # renamed out of the readers' sight first: a kill mid-way leaves trash the next sweep
        # removes, never a half-deleted step-N that a resume or `ckpt verify` trips over
        discard(folder)
        durable(f"pruned {folder}")
