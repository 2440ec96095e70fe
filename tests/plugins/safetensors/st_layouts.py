"""Models in the layouts of every strategy, built directly with torch.distributed.tensor.

``plain`` is what single and DDP hold (a full replica per rank), ``fsdp`` is FSDP2's
``fully_shard`` (Shard(0) DTensors), ``tp`` is ColwiseParallel/RowwiseParallel (Shard(0),
Shard(1) and Replicate), ``fsdp_tp`` is 2-D (dp x tp). Dimensions are odd on purpose so
shards are uneven. Used by the layout matrix test through ``run_on_ranks``.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from torch import nn

warnings.filterwarnings("ignore", message=".*FSDP2-wrapped module.*")


_MESHES: dict[str, Any] = {}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(7, 10)
        self.fc2 = nn.Linear(10, 5)
        self.register_buffer("scale", torch.arange(3, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def build(layout: str, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A fresh model in ``layout`` on the current process group, and its AdamW."""
    torch.manual_seed(seed)
    model = MLP()
    if layout in ("tp", "fsdp", "fsdp_tp"):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        world = dist.get_world_size()
        plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
        if layout == "fsdp_tp":
            if "2d" not in _MESHES:  # build the process groups once per process
                _MESHES["2d"] = init_device_mesh("cpu", (world // 2, 2),
                                                 mesh_dim_names=("dp", "tp"))
            mesh = _MESHES["2d"]
            parallelize_module(model, mesh["tp"], plan)
            fully_shard(model, mesh=mesh["dp"])
        else:
            if "1d" not in _MESHES:
                _MESHES["1d"] = init_device_mesh("cpu", (world,))
            mesh = _MESHES["1d"]
            if layout == "tp":
                parallelize_module(model, mesh, plan)
            else:
                fully_shard(model.fc1, mesh=mesh)
                fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    """One identical step on every rank (same batch everywhere keeps replicas equal)."""
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(seed))
    model(x).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def full(t: Any) -> torch.Tensor:
    if hasattr(t, "full_tensor"):
        return t.full_tensor()
    return t.detach().clone()


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor, gathered to full tensors (test-only comparison)."""
    out = {f"model/{k}": full(v) for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optim/{names[id(p)]}/{k}"] = full(v)
    return out


def save_layout(layout: str, directory: str, seed: int, steps: int = 2) -> dict[str, Any]:
    """Train ``steps`` steps in ``layout`` and save; return the full tensors saved."""
    from distrun_safetensors.save import Checkpointer

    model, opt = build(layout, seed)
    for i in range(steps):
        train_step(model, opt, seed * 100 + i)
    with torch.no_grad():  # make the buffer distinct from its initial value
        model.scale.add_(seed)
    rank = int(os.environ.get("RANK", "0"))
    saver = Checkpointer(directory, split_bytes=64)
    path = saver.save(steps, model, opt, {"progress": {"step": steps}, "who": rank},
                      reason="test")
    return {"path": path, "tensors": full_state(model, opt)}


def load_layout(layout: str, path: str) -> tuple[dict[str, torch.Tensor], Any, float]:
    """Load ``path`` into a fresh ``layout`` model (seeded differently); return its full
    tensors, the ``who`` entry of the contributed state this rank got back and the fraction
    of the checkpoint's tensor bytes this rank read."""
    import json

    from distrun_safetensors.files import DTYPE_SIZES

    model, opt = build(layout, seed=99)
    from distrun_safetensors.load import load

    result = load(path, model, opt)
    assert result is not None
    total = 0
    for name in ("model.safetensors.index.json", "optimizer.safetensors.index.json"):
        with open(os.path.join(path, name)) as fh:
            for info in json.load(fh)["distrun"]["tensors"].values():
                n = DTYPE_SIZES[info["dtype"]]
                for d in info["shape"]:
                    n *= d
                total += n
    return full_state(model, opt), result.state.get("who"), result.bytes_read / total


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors are not bit-identical (empty when all match)."""
    bad = [k for k in want if k not in got]
    bad += [k for k in got if k not in want]
    for k in want:
        if k in got and not (got[k].dtype == want[k].dtype and torch.equal(got[k], want[k])):
            bad.append(k)
    return bad


# -- rank functions for run_on_ranks (module level so spawn can import them) -----------------


def rank_save_and_load(rank: int, world: int, root: str, saves: list[tuple[str, int]],
                       loads: list[str], sources: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Save each ``(layout, seed)`` into ``root/<layout>x<world>``, then load every source
    (given and just saved) into each layout of ``loads``; return mismatches per cell."""
    saved = {}
    for layout, seed in saves:
        key = f"{layout}x{world}"
        saved[key] = save_layout(layout, os.path.join(root, key), seed)
    all_sources = {**sources, **saved}
    cells = {}
    for layout in loads:
        for key, ref in all_sources.items():
            got, who, share = load_layout(layout, ref["path"])
            bad = compare(got, ref["tensors"])
            # a sharded rank reads its share of the bytes; a replica reads everything once
            want = 1.0 if layout == "plain" else 1.0 / world
            if layout == "fsdp" and not (share <= want + 0.2):
                bad.append(f"read {share:.2f} of the checkpoint, expected about {want:.2f}")
            if layout == "plain" and abs(share - 1.0) > 1e-9:
                bad.append(f"read {share:.2f} of the checkpoint, expected all of it once")
            saved_world = int(key.rpartition("x")[2])
            # contributed state: this rank's own when the world size matches, else rank 0's
            if who != (rank if saved_world == world else 0):
                bad.append(f"state.who={who}")
            cells[f"{key} -> {layout}x{world}"] = bad
    return {"cells": cells, "saved": saved if rank == 0 else {}}


def reseal(folder: Any, name: str) -> None:
    """Fix the manifest's size and checksum of file ``name`` after a test changed it, so the
    check that follows the checksum is the one a damaged file hits."""
    import json

    from distrun_safetensors.checksums import checksum

    path = os.path.join(str(folder), "manifest.json")
    with open(path) as fh:
        manifest = json.load(fh)
    with open(os.path.join(str(folder), name), "rb") as fh:
        data = fh.read()
    algorithm = manifest.get("checksum") or "crc32"
    manifest["files"][name].update({"size": len(data), algorithm: checksum(data, algorithm)})
    with open(path, "w") as fh:
        json.dump(manifest, fh)
