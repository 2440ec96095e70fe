"""One live run per folder: the run folder, and every folder an option marks ``exclusive``.

A run holds ``flock(LOCK_EX)`` on ``FOLDER/.distrun-lock`` through a file descriptor it keeps
open for its life. The kernel frees the lock when the holder exits, however it exits (``kill
-9`` included), so a crashed run never blocks the next one. The file says who holds it: the
run's key, pid, host and start time. The key is the run's identity: the launcher makes one
(:data:`RUN_KEY_ENV`, handed to every worker and kept through elastic restarts); without a
launcher it is torchrun's ``TORCHELASTIC_RUN_ID``, or new. A process that finds the lock held
under its own key is part of that run and goes on; any other run is refused in one line. A
folder inside a held one (``--ckpt-dir runs/a/checkpoints`` while run ``a`` is live) is
refused too.

Who takes it: the launcher of a single-node run, for the whole launch (restarts included);
otherwise (several nodes, one launcher per rank, ``python train.py``, torchrun) the process of
global rank 0, for its life. The other ranks of a run never take it, so they never contend.

On NFS, Linux implements ``flock`` with byte-range locks that the server enforces for every
client (NFSv4, or NFSv3 with lockd): a live run on another host is refused as well, and a host
that dies loses its locks when the server's lease runs out (about 90 s). Mounted with
``local_lock=flock`` (or ``nolock``), or on a filesystem without shared locks, a lock is seen
only on its own host: two runs on two hosts can then share a folder unnoticed.
Torch-free.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import socket
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from distrun._spec.errors import UsageError

__all__ = ["LOCK_FILE", "RUN_KEY_ENV", "FolderLock", "lock_folder", "lock_run_folders",
           "first_missing", "make_folder", "new_run_key", "release_all", "remove_empty",
           "run_key"]

LOCK_FILE = ".distrun-lock"
#: the run's key, set by the launcher for every process of the run
RUN_KEY_ENV = "DISTRUN_RUN_KEY"
#: seconds to wait for a holder that has the lock but has not written its name yet
_NAMING = 2.0


def make_folder(path: str, what: str = "the run folder", flag: str = "--run-dir") -> None:
    """Make the folder ``path`` (and its parents); one line when the system refuses."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise UsageError(f"cannot make {what} {path}: {reason} (choose another {flag})") from None


def new_run_key(*shared: object) -> str:
    """A key no other run has; or, given what every node of a run is given alike (its name
    and where its nodes meet), the key every node of that run derives: the nodes of one run
    share its folders, the lock must know them for one run."""
    if shared:
        return "run-" + hashlib.sha256(repr(shared).encode()).hexdigest()[:32]
    return uuid.uuid4().hex


_own_key: str | None = None  # this process's key when nothing launched it


def _forget_own_key() -> None:
    global _own_key
    _own_key = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_own_key)


def run_key(environ: Mapping[str, str] | None = None, *, shared: Sequence[object] = ()) -> str:
    """This process's run key: its launcher's, else torchrun's run id, else its own (one per
    process, so its trainers one after another are one run).

    ``shared``: what every node of one run is given alike (its name and where its nodes meet),
    for a launcher of several nodes: the key every node of that run derives from it, the one
    it gives its workers.
    """
    global _own_key
    if shared:
        return new_run_key(*shared)
    environ = os.environ if environ is None else environ
    key = environ.get(RUN_KEY_ENV) or environ.get("TORCHELASTIC_RUN_ID")
    if key:
        return key
    if _own_key is None:
        _own_key = new_run_key()
    return _own_key


@dataclass
class FolderLock:
    """A folder this run uses; ``fd`` is the open lock (None: another process of the run
    holds it). ``made`` is the topmost folder that taking the lock created."""

    folder: str
    fd: int | None
    made: str | None = None

    def release(self, abandon: bool = False) -> None:
        """Free the lock. ``abandon`` (the run never started): also remove the lock file and
        the folders taking it made, when nothing else is in them."""
        if self.fd is not None:
            if abandon:
                try:
                    os.unlink(os.path.join(self.folder, LOCK_FILE))
                except OSError:
                    pass
            os.close(self.fd)
            self.fd = None
        if abandon and self.made:
            remove_empty(self.folder, self.made)


def remove_empty(folder: str, top: str) -> None:
    """Remove ``folder`` and its parents up to ``top`` while they are empty."""
    path, top = os.path.abspath(folder), os.path.abspath(top)
    while path.startswith(top):
        try:
            os.rmdir(path)
        except OSError:
            return
        if path == top:
            return
        path = os.path.dirname(path)


def first_missing(folder: str) -> str | None:
    """The topmost folder of ``folder``'s path that does not exist yet (None: all exist)."""
    path, missing = os.path.abspath(folder), None
    while not os.path.lexists(path):
        missing, parent = path, os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing


def _holder(fd: int) -> dict[str, Any]:
    """The holder's record in the lock file (it writes it right after taking the lock)."""
    deadline = time.monotonic() + _NAMING
    while True:
        try:
            raw = os.pread(fd, 4096, 0)
            return dict(json.loads(raw))
        except (OSError, ValueError, TypeError):
            if time.monotonic() > deadline:
                return {}
            time.sleep(0.02)


def _in_use(label: str, folder: str, holder: Mapping[str, Any], hint: str,
            inside: str | None = None) -> UsageError:
    process = " ".join(p for p in (f"pid {holder['pid']}" if "pid" in holder else "",
                                   f"on {holder['host']}" if "host" in holder else "") if p)
    who = ", ".join(p for p in (process, f"since {holder['since']}" if "since" in holder
                                else "") if p)
    if inside and not os.path.isabs(folder):
        inside = os.path.relpath(inside)
    where = f"{label} {folder} is inside {inside}, which" if inside else f"{label} {folder}"
    verb = "holds" if inside else "is in use by"
    return UsageError(f"{where} {verb} another live run{f' ({who})' if who else ''}: wait "
                      f"for it to end, or {hint}")


def _check_parents(folder: str, key: str, label: str, hint: str) -> None:
    """Refuse ``folder`` when a folder above it is held by another live run."""
    path = os.path.dirname(os.path.abspath(folder))
    while True:
        lock = os.path.join(path, LOCK_FILE)
        if os.path.isfile(lock):
            try:
                fd = os.open(lock, os.O_RDONLY)
            except OSError:
                fd = -1
            if fd >= 0:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except OSError:  # held: by whom?
                    holder = _holder(fd)
                    if holder.get("run") != key:
                        raise _in_use(label, folder, holder, hint, inside=path) from None
                finally:
                    os.close(fd)
        parent = os.path.dirname(path)
        if parent == path:
            return
        path = parent


def lock_folder(folder: str, key: str, label: str = "the run folder",
                hint: str = "give this run another --name or --run-dir") -> FolderLock:
    """Take ``folder`` for the run ``key`` (made if missing), or refuse in one line.

    Returns a :class:`FolderLock` whose ``fd`` is None when another process of the same run
    holds the lock (that process keeps it).
    """
    _check_parents(folder, key, label, hint)
    made = first_missing(folder)
    make_folder(folder, label, hint.rpartition(" ")[2])
    path = os.path.join(folder, LOCK_FILE)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise UsageError(f"cannot lock {label} {folder}: {exc.strerror} ({path})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                os.close(fd)
                raise UsageError(f"cannot lock {label} {folder}: {exc.strerror} "
                                 f"({path})") from None
            holder = _holder(fd)
            os.close(fd)
            if holder.get("run") == key:
                return FolderLock(folder, None, made)
            raise _in_use(label, folder, holder, hint) from None
        if _still_there(fd, path):
            break
        os.close(fd)  # an abandoned run removed the file we locked: lock the one there now
    record = {"run": key, "pid": os.getpid(), "host": socket.gethostname(),
              "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
    except OSError as exc:
        # the record is how the run's other processes know the lock is theirs: without it
        # they would be refused, so the run does not start (nothing of it is lost yet)
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise UsageError(f"cannot lock {label} {folder}: {exc.strerror} writing {path} (free "
                         f"space there, or {hint})") from None
    return FolderLock(folder, fd, made)


def _still_there(fd: int, path: str) -> bool:
    """Whether ``path`` is still the file ``fd`` locked (a holder removes it when its run
    never started)."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def lock_run_folders(config: Any, options: Iterable[Any], key: str) -> list[FolderLock]:
    """Lock the run folder and the folder of every ``exclusive`` option that is set."""
    wanted: list[tuple[str, str, str]] = []
    for opt in options:
        if not getattr(opt, "exclusive", False):
            continue
        value = config.get(opt.name, "")
        if not value:
            continue
        if opt.name == "run_dir":
            wanted.append((value, "the run folder", "give this run another --name or --run-dir"))
        else:
            wanted.append((value, opt.flag, f"give this run another {opt.flag}"))
    locks: list[FolderLock] = []
    seen: set[str] = set()
    try:
        for folder, label, hint in wanted:
            real = os.path.realpath(folder)
            if real in seen:
                continue
            seen.add(real)
            locks.append(lock_folder(folder, key, label, hint))
    except BaseException:
        release_all(locks, abandon=True)
        raise
    return locks


def release_all(locks: Iterable[FolderLock], abandon: bool = False) -> None:
    """Release ``locks``, the last taken first."""
    for lock in reversed(list(locks)):
        lock.release(abandon=abandon)
