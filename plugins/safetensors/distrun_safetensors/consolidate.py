"""``distrun ckpt consolidate``: a Hugging Face sharded safetensors folder from a checkpoint."""

from __future__ import annotations

import os
import shutil
from contextlib import closing
from typing import Any

import torch

from distrun_safetensors.files import (
    DTYPE_SIZES,
    CheckpointError,
    FileReaders,
    fsync_dir,
    write_json,
    write_safetensors,
)
from distrun_safetensors.manifest import MODEL_INDEX
from distrun_safetensors.pieces import DTYPES, read_box
from distrun_safetensors.validation import validate

__all__ = ["consolidate"]


def _nbytes(info: dict[str, Any]) -> int:
    n = DTYPE_SIZES[info["dtype"]]
    for d in info["shape"]:
        n *= d
    return n


def consolidate(folder: str, out: str, max_shard_bytes: int) -> dict[str, Any]:
    """Verify ``folder`` and write its model into ``out`` (which must not exist yet).

    Output: ``model-0000i-of-0000n.safetensors`` files of at most ``max_shard_bytes`` (a
    tensor larger than that gets a file of its own) and ``model.safetensors.index.json``.
    The folder appears complete or not at all (written aside, then renamed).
    """
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise CheckpointError(f"{out} already exists (choose a new output folder)")
    ckpt = validate(folder, verify=True)
    shards: list[list[str]] = [[]]
    size = 0
    for name, info in ckpt.model.items():
        nbytes = _nbytes(info)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    tmp = os.path.normpath(out) + ".partial"
    try:
        index = _write(ckpt, shards, tmp, out)
    except OSError as exc:  # a read-only or full disk, a path under a file: the user's to fix
        shutil.rmtree(tmp, ignore_errors=True)
        where = f" ({exc.filename})" if exc.filename else ""
        raise CheckpointError(f"cannot write {out}: {exc.strerror or exc}{where}; choose an "
                              "output folder on a disk you can write to, with room for the "
                              "model") from None
    return index


def _write(ckpt: Any, shards: list[list[str]], tmp: str, out: str) -> dict[str, Any]:
    """Write the shards and the index into ``tmp``, then rename it to ``out``."""
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    weight_map: dict[str, str] = {}
    with closing(FileReaders(ckpt.path)) as open_file:
        def assemble(name: str) -> Any:
            def get() -> memoryview:
                info = ckpt.model[name]
                full = torch.empty(info["shape"], dtype=DTYPES[info["dtype"]])
                if full.numel():
                    read_box(open_file, info, [0] * full.dim(), list(full.shape), full)
                return memoryview(full.reshape(-1).view(torch.uint8).numpy())
            return get

        for i, names in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            entries = [(n, ckpt.model[n]["dtype"], ckpt.model[n]["shape"],
                        _nbytes(ckpt.model[n])) for n in names]
            write_safetensors(os.path.join(tmp, fname), entries, (assemble(n) for n in names),
                              {"format": "pt"})
            weight_map.update({n: fname for n in names})
    index = {"metadata": {"total_size": sum(_nbytes(i) for i in ckpt.model.values()),
                          "step": ckpt.step},
             "weight_map": weight_map}
    write_json(os.path.join(tmp, MODEL_INDEX), index)
    fsync_dir(tmp)
    if os.path.isdir(out):
        os.rmdir(out)
    os.rename(tmp, out)
    fsync_dir(os.path.dirname(os.path.abspath(out)))
    return index
