"""The checksums a checkpoint's manifest can name, and how to compute them incrementally.

Format version 2 writes CRC-32C (Castagnoli): the ``crc32c`` package computes it with the
CPU's CRC instruction (SSE4.2 / ARMv8) at ~12 GB/s on one core of this machine, several times
the disk's write rate, and releases the GIL, so it overlaps the writes. Version 1 wrote zlib's
CRC-32 (~2.2 GB/s, as fast as the disk: it was what limited a save); readers still check it.

Torch-free (``distrun ckpt verify`` uses it).
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from typing import Any

from distrun.plugin import UsageError
from distrun_safetensors.paths import open_member

__all__ = ["DEFAULT", "Checksum", "checksum", "file_checksum"]

_CHUNK = 16 * 1024 * 1024


def _crc32c() -> Callable[[Any, int], int]:
    from crc32c import crc32c

    return crc32c


#: name in the manifest -> (update(data, value) -> value) factory
_ALGORITHMS: dict[str, Callable[[], Callable[[Any, int], int]]] = {
    "crc32c": _crc32c,
    "crc32": lambda: zlib.crc32,
}
#: what new checkpoints use
DEFAULT = "crc32c"


class Checksum:
    """A running checksum: ``update(bytes-like)`` in order, then ``hexdigest()`` (8 hex digits)."""

    def __init__(self, name: str = DEFAULT) -> None:
        make = _ALGORITHMS.get(name)
        if make is None:
            raise UsageError(f"unknown checksum {name!r} (this plugin knows "
                                  f"{', '.join(sorted(_ALGORITHMS))}); upgrade "
                                  "distrun-safetensors or load with --no-ckpt-verify")
        self.name = name
        self._update = make()
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = self._update(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value & 0xFFFFFFFF:08x}"


def checksum(data: bytes, name: str = DEFAULT) -> str:
    """The checksum of ``data`` as 8 hex digits."""
    c = Checksum(name)
    c.update(data)
    return c.hexdigest()


def file_checksum(path: str, name: str = DEFAULT) -> str:
    """The checksum of a whole file as 8 hex digits (read through :func:`open_member`: a file
    of its folder, never a link out)."""
    c = Checksum(name)
    with open_member(os.path.dirname(path), os.path.basename(path)) as fh:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while True:
            n = fh.readinto(buf)
            if not n:
                break
            c.update(view[:n])
    return c.hexdigest()
