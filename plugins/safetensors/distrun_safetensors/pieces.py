"""Which piece of which tensor this rank writes, and how a rank reads back the box it needs.

A *piece* is a block of a global tensor given by per-dimension offsets and a shape. Sharded
tensors (DTensor ``Shard``) contribute their local block; replicated data (plain tensors under
single/DDP, ``Replicate`` mesh dimensions of a DTensor) is spread across the ranks that hold
the same copy: large tensors are split into row ranges, small ones go whole to the least loaded
holder. Every rank computes the same plan from shapes alone, with no communication.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DTYPES", "Piece", "box_of", "plan_pieces", "read_box", "safetensors_dtype"]

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "U16": torch.uint16, "U32": torch.uint32,
    "U64": torch.uint64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
}
_NAMES = {v: k for k, v in DTYPES.items()}


def safetensors_dtype(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} cannot be stored in safetensors") from None


@dataclass
class Piece:
    """One block this rank writes: ``tensor`` holds global ``[offsets, offsets + shape)``."""

    name: str
    key: str
    dtype: str
    global_shape: list[int]
    offsets: list[int]
    tensor: torch.Tensor
    layout: str

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def describe(self) -> dict[str, Any]:
        return {"file": "", "key": self.key, "offsets": self.offsets,
                "shape": list(self.tensor.shape)}


def is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(t, DTensor)


def box_of(t: torch.Tensor) -> tuple[list[int], list[int]] | None:
    """(global offsets, local shape) of what ``t`` holds on this rank; None if nothing."""
    if not is_dtensor(t):
        return [0] * t.dim(), list(t.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if t.device_mesh.get_coordinate() is None:
        return None
    shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return list(offsets), list(shape)


def _holders(t: torch.Tensor, rank: int, world: int,
             members: tuple[int, ...] | None = None) -> tuple[tuple[int, ...], int]:
    """The ranks holding the same data as this rank for ``t``, and this rank's position.

    ``members``: the global ranks of a save that writes across some ranks only (one node's,
    the memory tier's), in the order of their ``rank`` in it: the holders are those among
    them (a plain tensor: all of them).

    A DTensor on a sub-mesh (FSDP's ``dp`` of an fsdp x tp mesh) is also held, identical, by
    the ranks of the parallel sub-meshes (the other ``tp`` ranks): they count as holders too,
    or each sub-mesh would write the tensor once. Meshes made apart from one root (each
    pipeline stage's own) are not extended: the other stages hold other tensors.
    """
    if not is_dtensor(t):
        return tuple(range(world)), rank
    if members is not None:
        group, me = _holders(t, members[rank], 0)
        group = tuple(r for r in group if r in members)
        return group, group.index(members[rank])
    from torch.distributed.tensor import Replicate

    mesh = t.device_mesh
    sharded = {name for name, p in zip(mesh.mesh_dim_names or (), t.placements, strict=False)
               if not isinstance(p, Replicate)}
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    names = root.mesh_dim_names or ()
    if root is not mesh and mesh.mesh_dim_names and set(mesh.mesh_dim_names) <= set(names) \
            and "pp" not in names:
        coord = root.get_coordinate()
        index: tuple[Any, ...] = tuple(c if n in sharded else slice(None)
                                       for n, c in zip(names, coord, strict=True))
        group = tuple(int(r) for r in root.mesh[index].flatten().tolist())
        return group, group.index(rank)
    coord = mesh.get_coordinate()
    index = tuple(slice(None) if isinstance(p, Replicate) else c
                  for p, c in zip(t.placements, coord, strict=False))
    group = tuple(int(r) for r in mesh.mesh[index].flatten().tolist())
    return group, group.index(rank)


def _materialize_partial(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import Partial, Replicate

    if any(isinstance(p, Partial) for p in t.placements):
        placements = [Replicate() if isinstance(p, Partial) else p for p in t.placements]
        t = t.redistribute(t.device_mesh, placements)
    return t


def plan_pieces(named: Iterable[tuple[str, torch.Tensor]], rank: int, world: int,
                split_bytes: int, members: tuple[int, ...] | None = None) -> list[Piece]:
    """The pieces this rank writes for ``named`` tensors (same order on every rank).

    ``rank`` and ``world`` are this rank's place in the save; ``members`` the global ranks of
    a save across some ranks only (see :func:`_holders`), None for one across all."""
    loads: dict[tuple[int, ...], list[int]] = {}
    out: list[Piece] = []
    for name, t in named:
        layout = "replicated"
        if is_dtensor(t):
            t = _materialize_partial(t)
            layout = f"{tuple(t.placements)} on mesh {tuple(t.device_mesh.shape)}"
        box = box_of(t)
        if box is None:
            continue
        offsets, shape = box
        local = t.to_local() if is_dtensor(t) else t
        local = local.detach()
        if t.numel() == 0:  # nothing to split: rank 0 records it so the index knows it
            if rank == 0:
                out.append(Piece(name=name, key=name, dtype=safetensors_dtype(t.dtype),
                                 global_shape=list(t.shape), offsets=[0] * t.dim(),
                                 tensor=torch.empty(t.shape, dtype=t.dtype), layout=layout))
            continue
        if local.numel() == 0:
            continue
        group, me = _holders(t, rank, world, members)
        load = loads.setdefault(group, [0] * len(group))
        nbytes = local.numel() * local.element_size()
        k = len(group)
        if k > 1 and local.dim() > 0 and nbytes >= split_bytes and local.shape[0] >= k:
            rows = local.shape[0]
            lo, hi = me * rows // k, (me + 1) * rows // k
            for i in range(k):
                load[i] += ((i + 1) * rows // k - i * rows // k) * nbytes // rows
            local = local[lo:hi]
            offsets = [offsets[0] + lo, *offsets[1:]]
        else:
            owner = min(range(k), key=lambda i: (load[i], i))
            load[owner] += nbytes
            if owner != me:
                continue
        full = list(local.shape) == list(t.shape)
        key = name if full else f"{name}@{','.join(map(str, offsets))}"
        out.append(Piece(name=name, key=key, dtype=safetensors_dtype(t.dtype),
                         global_shape=list(t.shape), offsets=offsets, tensor=local,
                         layout=layout))
    return out


def tensor_bytes(t: torch.Tensor) -> Callable[[], memoryview]:
    """A callable returning ``t``'s bytes on the CPU (a copy only if it must move or pack)."""

    def get() -> memoryview:
        cpu = t.detach()
        if cpu.device.type != "cpu":
            cpu = cpu.cpu()
        cpu = cpu.contiguous().reshape(-1)
        return memoryview(cpu.view(torch.uint8).numpy())

    return get


def read_box(open_file: Callable[[str], Any], info: dict[str, Any], offsets: list[int],
             shape: list[int], out: torch.Tensor) -> None:
    """Fill ``out`` (global box ``offsets``/``shape``) from the saved pieces that meet it.

    ``open_file(name)`` returns a :class:`~distrun_safetensors.files.FileReader`. Row ranges
    land in ``out``'s memory with one ``preadv``; other blocks go through ``get_slice``.
    """
    itemsize = out.element_size()
    for piece in info["pieces"]:
        p_off, p_shape = piece["offsets"], piece["shape"]
        lo = [max(a, b) for a, b in zip(offsets, p_off, strict=True)]
        hi = [min(a + s, b + t) for a, s, b, t in zip(offsets, shape, p_off, p_shape, strict=True)]
        if any(h <= low for h, low in zip(hi, lo, strict=True)):
            continue
        reader = open_file(piece["file"])
        dst = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets, strict=True))
        target = out[dst] if out.dim() else out
        rows = all(lo[d] == p_off[d] and hi[d] - lo[d] == p_shape[d]
                   for d in range(1, len(p_shape)))
        if out.device.type == "cpu" and rows and target.is_contiguous() and target.numel():
            row_bytes = itemsize
            for d in p_shape[1:]:
                row_bytes *= d
            start = (lo[0] - p_off[0]) * row_bytes if p_shape else 0
            buf = memoryview(target.reshape(-1).view(torch.uint8).numpy())
            reader.read_into(piece["key"], start, buf)
        elif out.dim() == 0:
            out.copy_(reader.safe().get_tensor(piece["key"]))
            reader.bytes_read += itemsize
        else:
            src = tuple(slice(a - p, b - p) for a, b, p in zip(lo, hi, p_off, strict=True))
            target.copy_(reader.safe().get_slice(piece["key"])[src])
            reader.bytes_read += target.numel() * itemsize


def covered(info: dict[str, Any], offsets: list[int], shape: list[int]) -> bool:
    """Whether the saved pieces fill the box (they never overlap: the index is checked)."""
    total = 0
    for piece in info["pieces"]:
        vol = 1
        for a, s, b, t in zip(offsets, shape, piece["offsets"], piece["shape"], strict=False):
            vol *= max(0, min(a + s, b + t) - max(a, b))
        total += vol
    need = 1
    for s in shape:
        need *= s
    return total == need
