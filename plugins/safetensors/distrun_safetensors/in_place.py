"""In-place saves: the snapshot of an async save copied straight into its checkpoint's files.

An async save normally copies each tensor into a reused CPU buffer (the step's stall), then a
background thread streams the buffers into the files. Where the files are memory themselves
(the memory tier's folder in ``/dev/shm``), that is three copies of the state per save (buffer,
write block, file) and, while a save commits, three copies held. An in-place save maps each of
this rank's data files and copies the tensors into the mapping: one copy, and the background
thread only checksums, syncs and commits. The files are byte for byte what
:func:`~distrun_safetensors.files.write_safetensors` writes, so loading is unchanged.

The files are recycled, so a save does not pay for fresh pages: once a save commits, this rank
keeps a hard link to each of its data files in ``.spare-<rank>/``; the next save but one takes
them (the checkpoint they belonged to is no longer the newest by then, and is pruned) and
writes over them. So a rank holds two copies of its share of the state, the newest committed
checkpoint and the one being written, and no buffers. A restarted rank that resumed from the
tier takes over the spares its killed process left, up to the step it resumed from, and writes
over their pages too (fresh pages cost a fault and a zeroing each: at 100M parameters the first
two saves after a restart took 0.55 s each of their step, the saves after them 0.06-0.15 s).

From a GPU, the mappings are registered with CUDA (``cudaHostRegister``) the first time a
save copies device memory into them, and stay registered while they are recycled: a copy into
pageable memory is staged through the driver's own small pinned buffers, a copy into
registered memory runs at the link's rate. On an H200 (the GPU lane's ``tier`` check) these
saves copied 1 GB in 78.7 ms into pageable files, in 20.4 ms registered, against 19.6 ms into
pinned buffers; registering took 39 ms a GB, once per mapping. A mapping is unregistered once
this rank lets go of it (no copy into it is in flight then: a save synchronizes before it
returns).

A save's snapshot can be written again elsewhere: :meth:`InPlace.snapshot` hands out its
tensors as they lie in the mapped files, and a disk save writes from them in the background
(:meth:`~distrun_safetensors.save.Checkpointer.save`'s ``snapshot``) instead of copying the
state once more. Until that write is done the step is pinned: its files are not written over
(a save then takes fresh files, one more copy for that while).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import shutil
import struct
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from distrun_safetensors.checksums import DEFAULT, checksum_in_parts
from distrun_safetensors.files import _header_bytes, durable
from distrun_safetensors.manifest import FORMAT, data_file

__all__ = ["InPlace", "Snapshot"]

log = logging.getLogger("distrun")

#: Linux's MAP_POPULATE (Python >= 3.10): fault the whole mapping in with one call
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


@dataclass
class Snapshot:
    """The tensors of one in-place save of ``step``, as they lie in its files; ``release()``
    once they are read (the step is pinned until then)."""

    step: int
    #: (kind, key) -> the piece's tensor in the mapping; None where its offset in the file
    #: does not suit its dtype (such a save is written from the live tensors instead)
    tensors: dict[tuple[str, str], torch.Tensor | None]
    release: Callable[[], None]


class InPlace:
    """One rank's in-place staging in ``directory`` (held by its :class:`Checkpointer`)."""

    def __init__(self, directory: str, rank: int) -> None:
        self.spares = os.path.join(directory, f".spare-{rank}")
        #: step -> {file name: (its spare link, its mapping; None: not mapped yet, a spare of
        #: an earlier process)}: the two newest steps, and any older one still pinned
        self._kept: dict[int, dict[str, tuple[str, torch.Tensor | None]]] = {}
        self._pins: dict[int, int] = {}
        self._lock = threading.Lock()  # a pin is released by the thread that wrote from it
        #: the last save staged: (step, its tensors in the mappings)
        self._staged: tuple[int, dict[tuple[str, str], torch.Tensor | None]] | None = None
        self._fresh = True
        #: the mappings registered with CUDA, by address
        self._registered = _Registered()

    def snapshot(self, step: int) -> Snapshot | None:
        """The tensors of this rank's save of ``step`` (the last one staged), pinned; None
        when the last save staged is of another step."""
        if self._staged is None or self._staged[0] != step:
            return None
        with self._lock:
            self._pins[step] = self._pins.get(step, 0) + 1
        released = []

        def release() -> None:
            if not released:
                released.append(True)
                with self._lock:
                    self._pins[step] -= 1
                    if not self._pins[step]:
                        del self._pins[step]
                    self._trim()

        return Snapshot(step, dict(self._staged[1]), release)

    def stage(self, job: dict[str, Any], tmp: str, newest: int | None) -> dict[str, Any]:
        """Map this rank's data files in ``tmp`` and copy its pieces into them (``newest``:
        the newest step committed so far); ``{file name: (path, mapping)}`` for
        :func:`finish`."""
        if self._fresh:  # an earlier process's spares
            self._fresh = False
            self._adopt(newest)
        with self._lock:
            reuse = self._take(newest)
        mapped: dict[str, Any] = {}
        tensors: dict[tuple[str, str], torch.Tensor | None] = {}
        on_gpu = False
        for kind in ("model", "optim"):
            mine = [p for k, p in job["pieces"] if k == kind]
            if not mine:
                continue
            name = data_file(kind, job["rank"], job["world"])
            entries = [(p.key, p.dtype, list(p.tensor.shape), p.nbytes) for p in mine]
            header, _ = _header_bytes(entries, {"format": "pt", "producer": FORMAT})
            start = 8 + len(header)
            size = start + sum(p.nbytes for p in mine)
            path = os.path.join(tmp, name)
            spare = reuse.pop(name, None)
            data = None
            if spare is not None:
                os.replace(spare[0], path)
                data = spare[1] if spare[1] is not None and spare[1].numel() == size else None
                if data is None and spare[1] is not None:
                    self._registered.drop(spare[1])
            if data is None:
                data = _mapped(path, size, fresh=spare is None)
            data[:start].copy_(torch.frombuffer(bytearray(struct.pack("<Q", len(header)) + header),
                                                dtype=torch.uint8))
            offset = start
            for p in mine:
                src = p.tensor.detach()
                cuda = src.device.type == "cuda"
                if cuda:
                    on_gpu = True
                    self._registered.add(data)
                view = data[offset:offset + p.nbytes]
                # into registered memory the copy is a DMA of its own, ordered on the stream
                view.copy_(src.reshape(-1).view(torch.uint8), non_blocking=cuda)
                tensors[(kind, p.key)] = _typed(view, src)
                offset += p.nbytes
            mapped[name] = (path, data)
        for link, data in reuse.values():  # a file this save no longer has
            self._registered.drop(data)
            with contextlib.suppress(OSError):
                os.unlink(link)
        if on_gpu:
            torch.cuda.synchronize()
        self._staged = (job["step"], tensors)
        return mapped

    def keep(self, step: int, folder: str, mapped: dict[str, Any]) -> None:
        """After ``step`` committed into ``folder``: link this rank's data files there as
        spares (written over two saves later, through the same mappings: no page is faulted
        in again), and drop those older than the step before."""
        os.makedirs(self.spares, exist_ok=True)
        kept: dict[str, tuple[str, torch.Tensor | None]] = {}
        for name, (_, data) in mapped.items():
            link = os.path.join(self.spares, f"{step}-{name}")
            with contextlib.suppress(OSError):
                os.link(os.path.join(folder, name), link)
                kept[name] = (link, data)
        with self._lock:
            self._kept[step] = kept
            self._trim()

    def _trim(self) -> None:
        """Let go of the spares of all but the two newest steps, pinned ones excepted."""
        for old in sorted(self._kept)[:-2]:
            if old not in self._pins:
                for link, data in self._kept.pop(old).values():
                    self._registered.drop(data)
                    with contextlib.suppress(OSError):
                        os.unlink(link)

    def _adopt(self, resumed: int | None) -> None:
        """Take over the spares an earlier process of this rank left (it was killed, and this
        one resumed from the tier's step ``resumed``): those of that step and older, as this
        process's own, to be written over once older than the newest committed step. Those of
        a newer step (a save that other nodes did not commit) and any of a process this one
        did not resume from (``resumed`` None) are let go."""
        if resumed is None:
            shutil.rmtree(self.spares, ignore_errors=True)
            return
        with contextlib.suppress(OSError):
            for name in os.listdir(self.spares):
                step, _, file = name.partition("-")
                link = os.path.join(self.spares, name)
                if step.isdigit() and file and int(step) <= resumed:
                    self._kept.setdefault(int(step), {})[file] = (link, None)
                else:
                    with contextlib.suppress(OSError):
                        os.unlink(link)

    def _take(self, newest: int | None) -> dict[str, tuple[str, torch.Tensor | None]]:
        """The spare files to write over: those of a step older than the newest committed one
        (whose files are the checkpoint a restart would load) that no write reads from."""
        for step in sorted(self._kept):
            if newest is not None and step < newest and step not in self._pins:
                return self._kept.pop(step)
        return {}


class _Registered:
    """Mappings registered with CUDA (page-locked, so that a copy from the GPU is one DMA),
    by address; registering is turned off, in one line, if the driver refuses it."""

    def __init__(self) -> None:
        self._addresses: set[int] = set()
        self._off = False

    def add(self, data: torch.Tensor) -> None:
        ptr = data.data_ptr()
        if self._off or ptr in self._addresses:
            return
        try:
            cudart = torch.cuda.cudart()
            code = int(cudart.cudaHostRegister(ptr, data.numel(), 0))
        except Exception as exc:  # a build without the call (torch's binding is not public)
            cudart, code = None, -1
            why = f"{type(exc).__name__}: {exc}"
        else:
            why = f"error {code}"
        if code:
            self._off = True
            clear = getattr(cudart, "cudaGetLastError", None)
            if clear is not None:  # (the runtime keeps a failed call's error for the next check)
                clear()
            log.warning("checkpoint: the memory tier's files could not be registered with CUDA "
                        "(%s); its saves copy from the GPU at pageable speed", why)
            return
        self._addresses.add(ptr)

    def drop(self, data: torch.Tensor | None) -> None:
        if data is not None and data.data_ptr() in self._addresses:
            self._addresses.discard(data.data_ptr())
            torch.cuda.cudart().cudaHostUnregister(data.data_ptr())


def _typed(view: torch.Tensor, like: torch.Tensor) -> torch.Tensor | None:
    """The bytes ``view`` as a tensor of ``like``'s dtype and shape; None where its offset
    does not suit the dtype."""
    try:
        return view.view(like.dtype).view(like.shape)
    except RuntimeError:
        return None


def _mapped(path: str, size: int, fresh: bool) -> torch.Tensor:
    """``path`` sized to ``size`` bytes with all its pages, mapped shared, as a byte tensor."""
    with open(path, "w+b" if fresh else "r+b") as fh:
        fh.truncate(size)
        # every page now, so that a full folder is an error here and never a SIGBUS on a
        # write into the mapping; and the mapping's page table filled at once, not a fault a page
        os.posix_fallocate(fh.fileno(), 0, size)
        mapping = mmap.mmap(fh.fileno(), size, flags=mmap.MAP_SHARED | _POPULATE)
    with warnings.catch_warnings():  # "the buffer is not writable": it is (a shared mapping)
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapping, dtype=torch.uint8)


def finish(path: str, data: torch.Tensor) -> dict[str, Any]:
    """Checksum and sync a mapped file (the background thread's part); its report."""
    digest = checksum_in_parts(data.numpy())  # in memory already: parts on free cores at once
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    durable(path)
    return {"size": data.numel(), DEFAULT: digest}
