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

__all__ = ["DEFAULT", "Checksum", "checksum", "checksum_in_parts", "file_checksum"]

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


#: the least a part of :func:`checksum_in_parts` holds (below it, thread hand-offs cost more)
_PART = 32 * 1024 * 1024
#: the threads of :func:`checksum_in_parts`, made at its first use: (pool, their number)
_POOL: tuple[Any, int] | None = None


def checksum_in_parts(data: Any, workers: int | None = None) -> str:
    """:func:`checksum` of a CRC-32C of ``data`` (a flat bytes-like object in memory), its parts
    computed by up to ``workers`` threads at once (default: the cores this process may run on,
    up to 4, less one for the training) and joined by :func:`crc32c_join`: the same 8 hex
    digits as one pass, in a fraction of its time where cores are free (a memory tier's save
    of a GPU's state waits for it: ~0.1 s a GB on one core)."""
    view = memoryview(data).cast("B")
    size = len(view)
    if workers is None:
        workers = min(4, len(os.sched_getaffinity(0)) - 1)
    parts = max(1, min(workers, size // _PART))
    if parts == 1:
        return checksum(view)
    global _POOL
    if _POOL is None or _POOL[1] < parts:
        from concurrent.futures import ThreadPoolExecutor

        _POOL = (ThreadPoolExecutor(max_workers=parts, thread_name_prefix="distrun-crc"), parts)
    crc = _crc32c()
    bounds = [size * i // parts for i in range(parts + 1)]
    values = list(_POOL[0].map(lambda i: crc(view[bounds[i]:bounds[i + 1]], 0), range(parts)))
    value = values[0]
    for i in range(1, parts):
        value = crc32c_join(value, values[i], bounds[i + 1] - bounds[i])
    return f"{value & 0xFFFFFFFF:08x}"


#: CRC-32C's polynomial, bit-reversed (the order its registers hold bits in)
_CASTAGNOLI = 0x82F63B78


def _mul(a: int, b: int) -> int:
    """a(x) * b(x) modulo the polynomial, both in the reversed bit order (bit 31 is x^0)."""
    product = 0
    for bit in range(32):
        if a & (0x80000000 >> bit):
            product ^= b
        b = (b >> 1) ^ _CASTAGNOLI if b & 1 else b >> 1
    return product


def _x_to_8n(n: int) -> int:
    """x^(8n) modulo the polynomial (the effect of n more bytes on a CRC's register), by
    squaring: x^8, x^16, x^32, ... for the bits of n."""
    result, power = 0x80000000, 0x00800000  # x^0, and x^8
    while n:
        if n & 1:
            result = _mul(power, result)
        power = _mul(power, power)
        n >>= 1
    return result


def crc32c_join(first: int, second: int, second_len: int) -> int:
    """The CRC-32C of A followed by B from that of A, that of B and B's length in bytes: A's
    register moved on by B's length (its pre- and post-inversions cancel out between the
    two), added to B's."""
    return _mul(_x_to_8n(second_len), first) ^ second


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
