"""Fencing: only the newest start of a run moves ``latest`` (FORMAT.md, "Fencing"). Torch-free.

Every start of a run that saves (each rendezvous round of an elastic run, each ``distrun run``)
draws a *generation* from the checkpoint folder at its first save: one more than the newest
one drawn so far, and at least the rendezvous generation (``run.generation``). A commit is a
compare-and-swap: under the folder's commit lock, rank 0 reads the newest generation drawn and
the one of the checkpoint ``latest`` names, and renames its folder into place and moves
``latest`` only when neither is newer than its own. A node left behind in an older round (cut
off by a partition, frozen, or a run started earlier on the same folder) is *fenced*: its save
is dropped and it fails with one line.

One start is one launcher's rendezvous round: the processes a launcher starts in one round
(its launcher, ``distrun.plugin.ProcessId.launcher()``, the run's key ``distrun.plugin.run_key``
and the rendezvous generation, recorded as the generation file's ``round``) share its
generation. Rank 0 of an elastic round or of a ``distrun run`` draws once anyway; the case is
``distrun run --ft``, whose replica groups are one run that a single launcher keeps in one round, each group writing while it is the lowest live
replica and restarted alone when it dies. A group that starts saving (its first save, or after a
restart) joins the generation its launcher's round drew when the folder's newest generation is
that one, instead of drawing a newer one that would fence the group that trains on beside it
(a live group, not a stale node). Who is stale among the groups of one round is torchft's
quorum's to say, not the folder's. A start that cannot name its launcher (no launcher
variables) always draws.

Why the folder draws the numbers rather than taking the rendezvous generation as it is: the
rendezvous store lives in one agent, so a job that is launched again (a requeue, a rerun with
``--resume auto``) counts its rounds from 1 again, below the generations already on disk. The
folder is the one thing every start of the run shares, so its counter keeps growing. A round
draws right after all its ranks agreed to its first save (a collective), so they were all alive
then; the round that replaces it forms only once some of them are gone and draws later, so a
stale round's number is always below the number of the round that replaced it.

The lock is a file made with ``link(2)``, atomic on local filesystems and on NFS (whose
``flock`` may be local to each client): ``.commit.lock``, linked from a uniquely named file
holding its holder's host, pid and a random token. A lock whose holder is a dead process of
this host is broken at once; one held by another host is broken once this process has seen the
same token for :data:`STALE_AFTER` seconds (its own monotonic clock: hosts' clocks need not
agree). Holders keep it for a few file operations and check it is still theirs right before
each rename; a holder frozen for longer than :data:`STALE_AFTER` between that check and its
rename is the one case a lock on a plain filesystem cannot stop: its folder then carries an
older generation, which ``--resume`` ranks below the newer round's.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from distrun.plugin import ProcessId, run_key
from distrun_safetensors.errors import CheckpointError, FencedError
from distrun_safetensors.files import fsync_dir
from distrun_safetensors.manifest import (
    manifest_generation,
    read_generation_file,
    read_latest,
    read_manifest_quietly,
)
from distrun_safetensors.paths import GENERATION_FILE, read_member

__all__ = ["LOCK", "STALE_AFTER", "CommitLock", "LockLost", "Stale", "clear_dead_lock",
           "draw_generation", "fenced_error", "find_stale", "round_key"]

#: the commit lock of a checkpoints folder
LOCK = ".commit.lock"
#: seconds a lock held by another host must stay unchanged before it is broken
STALE_AFTER = 30.0
#: seconds to wait for a lock held by live writers before giving up
WAIT_LIMIT = 600.0
HOST = socket.gethostname()


class LockLost(Exception):
    """The commit lock was broken while this process held it (it was frozen too long)."""


class CommitLock:
    """The commit lock of ``directory`` (a context manager; see the module docstring)."""

    def __init__(self, directory: str, stale_after: float = STALE_AFTER,
                 wait_limit: float = WAIT_LIMIT) -> None:
        self.directory = directory
        self.path = os.path.join(directory, LOCK)
        self.stale_after = stale_after
        self.wait_limit = wait_limit
        self.token: str | None = None

    def __enter__(self) -> CommitLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def acquire(self) -> None:
        token = uuid.uuid4().hex
        mine = f"{self.path}-{token[:16]}"
        record = {"host": HOST, "pid": os.getpid(), "token": token, "at": time.time()}
        fd = os.open(mine, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o644)
        try:  # not fsynced: a record lost in a crash is judged by its age like any other
            os.write(fd, json.dumps(record).encode())
        except OSError:  # a full disk: no attempt of ours is left behind
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(mine)
            raise
        os.close(fd)
        started = time.monotonic()
        seen: tuple[str, float] | None = None  # (token of the lock seen, since when)
        pause = 0.01
        try:
            while True:
                with contextlib.suppress(FileExistsError):
                    os.link(mine, self.path)
                # link(2)'s reply can be lost on NFS: the link count says whether it took
                if os.lstat(mine).st_nlink >= 2:
                    self.token = token
                    return
                holder = _read_record(self.path)
                try:
                    st = os.lstat(self.path)
                except FileNotFoundError:
                    continue  # released meanwhile: try again at once
                now = time.monotonic()
                if holder is not None and _dead_here(holder):
                    self._break(holder)
                    continue
                # the same lock: its token, or (a record lost in a crash) the same file
                ident = str((holder or {}).get("token") or f"{st.st_ino}:{st.st_mtime_ns}")
                if seen is None or seen[0] != ident:
                    seen = (ident, now)
                elif now - seen[1] >= self.stale_after:
                    self._break(holder or {})
                    continue
                if now - started > self.wait_limit:
                    who = _who(holder)
                    raise CheckpointError(
                        f"{self.path}: the commit lock is still held by {who} after "
                        f"{self.wait_limit:.0f} s (remove it if no run writes {self.directory})")
                time.sleep(pause)
                pause = min(pause * 2, 0.5)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(mine)

    def _break(self, holder: dict[str, Any]) -> None:
        """Remove a stale lock; one that was replaced meanwhile is put back."""
        aside = f"{self.path}.broken-{uuid.uuid4().hex[:16]}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        try:
            moved = _read_record(aside)
            if moved is not None and moved.get("token") != holder.get("token"):
                # a new holder took the lock after we judged the old one: give it back (if
                # someone took the free name in between, that holder learns it at its check)
                with contextlib.suppress(FileExistsError):
                    os.link(aside, self.path)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(aside)

    def ensure(self) -> None:
        """Raise :class:`LockLost` unless this process still holds the lock."""
        holder = _read_record(self.path)
        if self.token is None or holder is None or holder.get("token") != self.token:
            raise LockLost(self.path)

    def release(self) -> None:
        if self.token is None:
            return
        holder = _read_record(self.path)
        if holder is not None and holder.get("token") == self.token:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self.token = None


def clear_dead_lock(directory: str) -> bool:
    """Remove the commit lock of ``directory`` and the files of lock attempts left by dead
    processes of this host (a writer killed while committing); True when the lock went."""
    path = os.path.join(directory, LOCK)
    try:
        names = [n for n in os.listdir(directory) if n.startswith(f"{LOCK}-")]
    except OSError:
        return False
    for name in names:  # an attempt's own file: its holder unlinks it once it has the lock
        attempt = os.path.join(directory, name)
        record = _read_record(attempt)
        if record is not None and _dead_here(record):
            with contextlib.suppress(OSError):
                os.unlink(attempt)
    holder = _read_record(path)
    if holder is None or not _dead_here(holder):
        return False
    CommitLock(directory)._break(holder)
    return not os.path.lexists(path)


def _read_record(path: str) -> dict[str, Any] | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        record = json.loads(os.read(fd, 4096) or b"null")
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return record if isinstance(record, dict) else None


def _dead_here(holder: dict[str, Any]) -> bool:
    pid = holder.get("pid")
    return holder.get("host") == HOST and isinstance(pid, int) \
        and not ProcessId(pid).alive()


def _who(holder: dict[str, Any] | None) -> str:
    if holder is None:
        return "another writer"
    return f"pid {holder.get('pid')} on host {holder.get('host')}"


# -- generations --------------------------------------------------------------------------------


def _newest(directory: str) -> int:
    """The newest generation drawn in ``directory``: its ``generation`` file, or the one of
    the checkpoint ``latest`` names when that is newer (a folder from before the file)."""
    drawn = read_generation_file(directory)
    latest, _ = read_latest(directory)
    committed = manifest_generation(read_manifest_quietly(latest)) if latest else 0
    return max(drawn, committed)


def round_key(rdzv_generation: int = 0, environ: Mapping[str, str] | None = None) -> str | None:
    """The identity of this process's start of the run (see the module docstring): its
    launcher (host, pid and the pid's start time), the run's key and ``rdzv_generation``;
    None when the process was not started by a distrun launcher."""
    env = os.environ if environ is None else environ
    launcher = ProcessId.launcher(environ)
    if launcher is None:
        return None
    if launcher.start is None:  # the launcher is gone: nothing left to share a round with
        return None
    return f"{run_key(env)}/{HOST}/{launcher.pid}/{launcher.start}/{rdzv_generation}"


def _drawn_round(directory: str) -> str | None:
    """The ``round`` the generation file records (None: none, or unreadable)."""
    try:
        record = json.loads(read_member(directory, GENERATION_FILE, 4096, "generation file"))
    except (OSError, ValueError, CheckpointError):
        return None
    found = record.get("round") if isinstance(record, dict) else None
    return found if isinstance(found, str) else None


def draw_generation(directory: str, rdzv_generation: int = 0,
                    stale_after: float = STALE_AFTER) -> int:
    """Draw this start's generation from ``directory`` (rank 0, at its first save): one more
    than the newest drawn, at least ``rdzv_generation``; recorded before it is returned. A
    process of the round that drew the newest generation joins it (see the module
    docstring)."""
    os.makedirs(directory, exist_ok=True)
    mine = round_key(rdzv_generation)
    with CommitLock(directory, stale_after):
        newest = _newest(directory)
        if mine is not None and newest == read_generation_file(directory) and newest > 0 \
                and newest >= rdzv_generation and _drawn_round(directory) == mine:
            return newest
        value = max(newest + 1, rdzv_generation)
        record = {"generation": value, "rdzv_generation": rdzv_generation, "host": HOST,
                  "pid": os.getpid(), "at": time.time(), "round": mine}
        tmp = os.path.join(directory, f"{GENERATION_FILE}-{uuid.uuid4().hex[:8]}")
        with open(tmp, "w") as fh:
            fh.write(json.dumps(record) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, os.path.join(directory, GENERATION_FILE))
        fsync_dir(directory)
    return value


@dataclass(frozen=True)
class Stale:
    """Why a commit of ``mine`` is fenced: a newer generation started or committed."""

    newer: int
    committed: bool  # True: ``latest`` names a checkpoint of generation ``newer``
    latest_step: int | None


def find_stale(directory: str, mine: int, step_of_mine: int | None = None) -> Stale | None:
    """Why generation ``mine`` may not commit (its step ``step_of_mine``) in ``directory``
    now, or None when it may (call it under the commit lock).

    Within one generation ``latest`` never moves back: the processes of one round train in
    step, so a commit of an older step than ``latest``'s is a writer that was frozen or cut
    off while the round went on (the groups of an ``--ft`` run share their round)."""
    latest, _ = read_latest(directory)
    manifest = read_manifest_quietly(latest) if latest else None
    committed = manifest_generation(manifest)
    step = manifest.get("step") if manifest else None
    step = step if isinstance(step, int) else None
    if committed > mine or (committed == mine and step_of_mine is not None
                            and step is not None and step_of_mine < step):
        return Stale(committed, True, step)
    drawn = read_generation_file(directory)
    if drawn > mine:
        return Stale(drawn, False, step)
    return None


def fenced_error(stale: Stale, mine: int, step: int, directory: str) -> FencedError:
    """The one line a fenced commit fails with."""
    if stale.committed and stale.newer == mine:
        return FencedError(
            f"fenced: step {stale.latest_step} of this round is committed in {directory}; this "
            f"writer's checkpoint of step {step} is older (it was frozen or cut off while the "
            "run went on) and was not committed")
    if stale.committed:
        what = f"round {stale.newer} has committed step {stale.latest_step}"
    else:
        where = f" (latest: step {stale.latest_step})" if stale.latest_step is not None else ""
        what = f"round {stale.newer} has started since{where}"
    return FencedError(
        f"fenced: {what}; this node's round {mine} is stale (the run re-formed without it, or "
        f"a newer run writes {directory}); its checkpoint of step {step} was not committed")
