"""A small real disk for tests: a tmpfs of a given size, mounted for one test (root only).

A full disk is met, not simulated: writes past the size fail with ``ENOSPC`` in the kernel, as
they do on a full volume. Torch-free.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["small_disk"]


@contextlib.contextmanager
def small_disk(where: Path, size: str, fill: int = 0) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` (``"64k"``, ``"1m"``) at the new folder ``where``, with a
    file of ``fill`` bytes already taking that much of it; unmounted when the block ends.
    Skips the test where it cannot be mounted (not root, no mount(8))."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a small disk is a tmpfs: mounting one needs root and mount(8)")
    where.mkdir(parents=True)
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        if fill:
            (where / "filler").write_bytes(b"\0" * fill)
        yield where
    finally:
        # lazy: a process of the test that still has a file open there does not keep it
        subprocess.run(["umount", "-l", str(where)], check=True)
