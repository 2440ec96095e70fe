"""Saves that never committed: ``.tmp-step-N-<id>/`` folders and their ``.lock`` files, which
of them are abandoned, and removing those (``distrun ckpt ls`` / ``clean``, a run's start, the
pruning after a commit). Torch-free.

The writer of a save (rank 0) takes an exclusive ``flock`` on ``.tmp-step-N-<id>.lock`` before
it creates the folder, writes into it who it is (host, pid, start time) and holds the lock until
the folder is committed or removed; the kernel drops the lock when the process dies, however it
dies. So a leftover is abandoned when

- it was written on this host and its lock is free: its writer is gone;
- it was written on another host, whose locks this host may not see (``flock`` on NFS can be
  local to each client), its lock is not seen held, and nothing in it changed for longer than
  the run's timeout (a live save writes its files, and no save outlives its collectives'
  timeout without them failing).

A lock file without a record (written by an earlier version) counts as this host's.

A checkpoint folder that is removed (pruned, or a committed copy a new save of its step
replaced) is first renamed to ``.pruned-<name>-<id>`` (:func:`discard`): a removal cut short
by a kill leaves that name, which no reader takes for a checkpoint, never a half-deleted
``step-N``. Such trash is removed with the leftovers (:func:`sweep_stale`, ``ckpt clean``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any

from distrun_safetensors.files import fsync_dir

__all__ = ["LOCK_SUFFIX", "TMP_PREFIX", "TRASH_PREFIX", "Leftover", "claim", "discard",
           "find_leftovers", "find_trash", "remove", "sweep_stale"]

#: next to each temporary folder: a file its writer holds an exclusive flock on
LOCK_SUFFIX = ".lock"
TMP_PREFIX = ".tmp-step-"
#: a checkpoint folder being removed (see :func:`discard`): never read, removed by the sweeps
TRASH_PREFIX = ".pruned-"
_STEP = re.compile(r"^\.tmp-step-(\d+)-")
HOST = socket.gethostname()


@dataclass(frozen=True)
class Leftover:
    """A temporary folder of a save (or its lock file alone) and what became of its writer."""

    path: str  # the folder ``.tmp-step-N-<id>`` (absent when only the lock is left)
    step: int | None
    abandoned: bool
    why: str  # "its writer (pid 12 on this host) is gone", "being written by pid 12 ..."


def claim(tmp: str) -> int:
    """Lock ``tmp``'s lock file for this process (before the folder exists) and record the
    writer in it; return the descriptor (closing it releases the lock)."""
    fd = os.open(tmp + LOCK_SUFFIX, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"host": HOST, "pid": os.getpid(),
                                 "started": time.time()}).encode())
    except BaseException as exc:
        with contextlib.suppress(OSError):  # its name is this save's own: nobody else's lock
            os.unlink(tmp + LOCK_SUFFIX)
        os.close(fd)
        if isinstance(exc, OSError) and not exc.filename and exc.strerror:
            raise OSError(exc.errno, exc.strerror, tmp + LOCK_SUFFIX) from exc
        raise
    return fd


def _writer(lock: str) -> dict[str, Any]:
    """The record in a lock file (``{}`` when there is none or it is unreadable)."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return {}
    try:
        record = json.loads(os.read(fd, 4096) or b"{}")
    except (OSError, ValueError):
        return {}
    finally:
        os.close(fd)
    return record if isinstance(record, dict) else {}


def _held(lock: str) -> bool:
    """Whether a process holds the lock file's flock (as far as this host can see)."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False  # no lock file: nobody can hold it
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # closing drops the probe's own lock
    return False


def _untouched_for(path: str) -> float:
    """Seconds since anything in the leftover (the lock, the folder, its files) changed."""
    newest = 0.0
    for p in (path, path + LOCK_SUFFIX):
        with contextlib.suppress(OSError):
            newest = max(newest, os.lstat(p).st_mtime)
    with contextlib.suppress(OSError):
        for entry in ([] if os.path.islink(path) else os.scandir(path)):  # never followed
            with contextlib.suppress(OSError):
                newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
    return time.time() - newest


def _judge(path: str, timeout: float | None) -> Leftover:
    m = _STEP.match(os.path.basename(path))
    step = int(m.group(1)) if m else None
    lock = path + LOCK_SUFFIX
    record = _writer(lock)
    host, pid = record.get("host"), record.get("pid")
    here = host is None or host == HOST
    who = f"pid {pid}" if pid is not None else "its writer"
    where = "on this host" if here else f"on host {host}"
    if _held(lock):
        return Leftover(path, step, False, f"being written by {who} {where}")
    if here:
        return Leftover(path, step, True, f"{who} {where} is gone (a save that never "
                                          "committed)")
    age = _untouched_for(path)
    if timeout is not None and age > timeout:
        return Leftover(path, step, True, f"written by {who} {where}, untouched for {age:.0f} s "
                                          f"(longer than the timeout, {timeout:g} s)")
    limit = f"{timeout:g} s" if timeout is not None else "the run's timeout"
    return Leftover(path, step, False, f"written by {who} {where} {age:.0f} s ago (may still "
                                       f"be saving; abandoned once untouched for {limit})")


def find_leftovers(directory: str, timeout: float | None = None) -> list[Leftover]:
    """The temporary folders of ``directory`` (and lock files whose folder is gone), oldest
    step first. ``timeout``: seconds after which another host's leftover is abandoned (None:
    never judged abandoned here)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    tmp = {n for n in names if n.startswith(TMP_PREFIX) and not n.endswith(LOCK_SUFFIX)}
    tmp |= {n[:-len(LOCK_SUFFIX)] for n in names
            if n.startswith(TMP_PREFIX) and n.endswith(LOCK_SUFFIX)}
    found = [_judge(os.path.join(directory, n), timeout) for n in tmp]
    return sorted(found, key=lambda f: (f.step if f.step is not None else -1, f.path))


def remove(path: str) -> bool:
    """Remove a leftover under its lock (never one whose lock is held); True when removed."""
    lock = path + LOCK_SUFFIX
    try:
        fd = os.open(lock, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o644)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: a live save of this or another run
            return False
        if os.path.islink(path):
            os.unlink(path)  # never followed
        else:
            shutil.rmtree(path, ignore_errors=True)
        os.unlink(lock)
        return not os.path.lexists(path)
    except OSError:
        return False
    finally:
        os.close(fd)


def discard(path: str) -> None:
    """Remove the checkpoint folder ``path`` so that a kill at any moment leaves either the
    whole folder or a trash name: rename it to ``.pruned-<name>-<id>`` (atomic), sync the
    parent, then delete it. A link is removed, never followed."""
    directory, name = os.path.split(os.path.normpath(path))
    trash = os.path.join(directory, f"{TRASH_PREFIX}{name.lstrip('.')}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    fsync_dir(directory)  # the rename is on disk before the first file of the folder goes
    _delete(trash)


def _delete(path: str) -> None:
    if os.path.islink(path) or not os.path.isdir(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def find_trash(directory: str) -> list[str]:
    """The ``.pruned-*`` entries of ``directory``: removals a kill cut short."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(os.path.join(directory, n) for n in names if n.startswith(TRASH_PREFIX))


def remove_trash(path: str) -> bool:
    """Finish the removal of a ``.pruned-*`` entry; True when it is gone."""
    _delete(path)
    return not os.path.lexists(path)


def sweep_stale(directory: str, timeout: float | None = None) -> list[str]:
    """Remove the abandoned leftovers of ``directory`` (see :func:`find_leftovers`) and the
    trash of removals cut short (:func:`find_trash`); return the folders removed. Safe when
    several runs share the folder: a leftover whose lock is held is left alone."""
    from distrun_safetensors.fence import clear_dead_lock

    clear_dead_lock(directory)  # a commit killed while it held the folder's commit lock
    removed = []
    for leftover in find_leftovers(directory, timeout):
        if not leftover.abandoned:
            continue
        existed = os.path.lexists(leftover.path)
        if remove(leftover.path) and existed:
            removed.append(leftover.path)
    for trash in find_trash(directory):  # never read by anyone: no lock needed
        if remove_trash(trash):
            removed.append(trash)
    return removed
