"""The one rule for every file read from a folder a user gives: a checkpoint folder, a
checkpoints folder (its ``latest`` and ``best`` pointers), an ``--init-weights`` folder.

A file is read only when its name is a plain name (no ``/``, no ``..``), its real path stays in
the folder (a symlink inside the folder to another file of it is fine; one that leaves is
refused), and it is a regular file (a FIFO would block the reader forever, a device never
ends). :func:`open_member` checks all three and opens the file; every reader of such a file
goes through it (or :func:`read_member`; :func:`checked_path` for ``safe_open``, which takes a
path). A file the user names directly is checked against its own folder. Torch-free.
"""

from __future__ import annotations

import errno
import fcntl
import io
import os
import re
import stat
from typing import Any

from distrun_safetensors.errors import CheckpointError

__all__ = ["GENERATION_FILE", "checked_path", "member", "open_member", "read_member"]

_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
#: the one hidden file read from a checkpoints folder: the newest generation drawn (fence.py)
GENERATION_FILE = ".generation"


def member(folder: str, name: Any, kind: str = "checkpoint") -> str:
    """The path of file ``name`` inside ``folder``; refuse anything that could leave it.

    ``kind`` names the folder in messages (``checkpoint``, ``weights``).
    """
    if not isinstance(name, str) or name != GENERATION_FILE and (
            not _SAFE_NAME.match(name) or ".." in name):
        raise CheckpointError(
            f"{folder}: file name {str(name)[:200]!r} in the {kind} is not a plain file name "
            f"inside the folder (refusing to read outside the {kind})")
    path = os.path.join(folder, name)
    if os.path.dirname(os.path.realpath(path)) != os.path.realpath(folder):
        raise CheckpointError(
            f"{path} is a link that leaves the {kind} folder (refusing to read it)")
    return path


def open_member(folder: str, name: Any, kind: str = "checkpoint") -> io.BufferedReader:
    """Open file ``name`` of ``folder`` for binary reading, after :func:`member`'s checks.

    Raises :class:`CheckpointError` for a name or a link that leaves the folder and for
    anything but a regular file; ``OSError`` (``FileNotFoundError``...) as ``open`` does.
    The checked real path is opened with ``O_NOFOLLOW``, so a link swapped in after the
    check is refused too.
    """
    path = member(folder, name, kind)
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(os.path.realpath(path), flags)  # O_NONBLOCK: a FIFO must not block here
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # the checked file became a link since
            raise CheckpointError(f"{path} is a link that leaves the {kind} folder "
                                  "(refusing to read it)") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a folder" if stat.S_ISDIR(mode) else "not a regular file"
            raise CheckpointError(f"{path} is {kind} (refusing to read it)")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_member(folder: str, name: Any, limit: int, what: str = "file",
                kind: str = "checkpoint") -> bytes:
    """The bytes of file ``name`` of ``folder`` (checked as :func:`open_member`); a file
    larger than ``limit`` bytes is refused without being read."""
    with open_member(folder, name, kind) as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > limit:
            raise CheckpointError(f"{os.path.join(folder, name)}: {what} is {size} bytes, too "
                                  "large to be one")
        return fh.read(limit + 1)


def checked_path(folder: str, name: Any, kind: str = "checkpoint") -> str:
    """The real path of file ``name`` of ``folder`` once :func:`open_member` accepted it, for
    readers that take a path (``safetensors.safe_open``)."""
    with open_member(folder, name, kind):
        return os.path.realpath(os.path.join(folder, name))

