"""Hugging Face weight folders written with the real `safetensors` library, and the rank
functions of the --init-weights tests (module level, so spawned ranks import them)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

INDEX = "model.safetensors.index.json"


def write_hf(folder: str, tensors: dict[str, torch.Tensor], shards: int = 2) -> dict[str, str]:
    """Write ``tensors`` as save_pretrained does: ``model-0000i-of-0000n.safetensors`` and
    ``model.safetensors.index.json`` ({"metadata": {"total_size"}, "weight_map"}); one
    ``model.safetensors`` when ``shards`` is 1. Returns the weight map."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    names = list(tensors)
    if shards == 1:
        save_file({k: v.contiguous() for k, v in tensors.items()},
                  os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        return {}
    weight_map = {}
    for i in range(shards):
        part = names[i * len(names) // shards:(i + 1) * len(names) // shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in part}, os.path.join(folder, fname),
                  metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(folder, INDEX), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
    return weight_map


def source_tensors(seed: int = 11) -> dict[str, torch.Tensor]:
    """Weights for st_layouts.MLP, different from any seed's initialisation."""
    from st_layouts import MLP

    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=gen).to(v.dtype) if v.is_floating_point()
            else v.clone() for k, v in MLP().state_dict().items()}


def full(t: Any) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


def rank_load_layouts(rank: int, world: int, folder: str) -> dict[str, Any]:
    """Load ``folder`` into fresh models in DDP's (plain), FSDP's and TP's layouts; for each,
    the reassembled full tensors, the bytes this rank read and how the shards were opened."""
    from st_layouts import build

    from distrun_safetensors import load_weights

    out = {}
    for layout in ("plain", "fsdp", "tp"):
        model, _ = build(layout, seed=rank + 50)  # every rank starts elsewhere
        result = load_weights(folder, model)
        out[layout] = {"tensors": {k: full(v) for k, v in model.state_dict().items()},
                       "bytes_read": result.bytes_read, "opened": result.files_opened,
                       "max_open": result.max_open,
                       "local": {k: (v.to_local() if hasattr(v, "to_local") else v).numel()
                                 for k, v in model.state_dict().items()}}
    return out
