"""What one rank of a save writes into the checkpoint's temporary folder: its pieces of the
model's and the optimizer's tensors (the optimizer's state keyed by parameter name) as
safetensors files, and the run's state as JSON plus its tensors; :mod:`~distrun_safetensors.save`
gathers each rank's report of them to commit the folder.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from distrun_safetensors.files import write_json, write_safetensors
from distrun_safetensors.in_place import finish
from distrun_safetensors.manifest import FORMAT, data_file, state_files
from distrun_safetensors.pieces import tensor_bytes
from distrun_safetensors.statecodec import encode

__all__ = ["collect_optimizer", "optimizer_names"]


def optimizer_names(optimizer: Any, model: torch.nn.Module) -> list[list[str]]:
    """Parameter names of each optimizer param group, in ``state_dict`` index order."""
    names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    out, i = [], 0
    for group in optimizer.param_groups:
        row = []
        for p in group["params"]:
            row.append(names.get(id(p), f"#{i}"))
            i += 1
        out.append(row)
    return out


def collect_optimizer(optimizer: Any, model: torch.nn.Module) -> tuple[
        list[tuple[str, torch.Tensor]], dict[str, Any]]:
    """(named state tensors, JSON description) of an optimizer, keyed by parameter name."""
    sd = optimizer.state_dict()
    groups = optimizer_names(optimizer, model)
    flat = [n for row in groups for n in row]
    tensors: list[tuple[str, torch.Tensor]] = []
    state: dict[str, Any] = {}
    for index, values in sd["state"].items():
        pname = flat[index]
        entry = {}
        for skey, value in values.items():
            if isinstance(value, torch.Tensor):
                tname = f"{pname}/{skey}"
                tensors.append((tname, value))
                entry[skey] = {"__tensor__": tname}
            else:
                entry[skey] = encode(value, f"optimizer.{pname}.{skey}", None)
        state[pname] = entry
    param_groups = []
    for group, row in zip(sd["param_groups"], groups, strict=False):
        hyper = {k: encode(v, f"optimizer.param_groups.{k}", None)
                 for k, v in group.items() if k != "params"}
        param_groups.append({"params": row, **hyper})
    return tensors, {"param_groups": param_groups, "state": state,
                     "class": type(optimizer).__name__}


def _write_rank_files(job: dict[str, Any], tmp: str) -> dict[str, Any]:
    """Write this rank's files into ``tmp``; a system error names the file it hit."""
    current: list[str] = []
    try:
        return _write_files(job, tmp, current)
    except OSError as exc:
        if exc.filename or not current or exc.strerror is None:
            raise
        raise OSError(exc.errno, exc.strerror, current[-1]) from exc


def _write_files(job: dict[str, Any], tmp: str, current: list[str]) -> dict[str, Any]:
    rank, world = job["rank"], job["world"]
    files: dict[str, Any] = {}
    described: dict[str, dict[str, Any]] = {"model": {}, "optim": {}}
    for kind in ("model", "optim"):
        mine = [p for k, p in job["pieces"] if k == kind]
        if not mine:
            continue
        fname = data_file(kind, rank, world)
        entries = [(p.key, p.dtype, list(p.tensor.shape), p.nbytes) for p in mine]
        current.append(os.path.join(tmp, fname))
        if fname in job.get("mapped", ()):  # copied into the file already (in_place.py)
            files[fname] = finish(*job["mapped"][fname])
        else:
            files[fname] = write_safetensors(current[-1], entries,
                                             (tensor_bytes(p.tensor) for p in mine),
                                             {"format": "pt", "producer": FORMAT})
        for p in mine:
            d = described[kind].setdefault(p.name, {
                "tensor": {"dtype": p.dtype, "shape": p.global_shape, "layout": p.layout},
                "pieces": []})
            d["pieces"].append({"file": fname, "key": p.key, "offsets": p.offsets,
                                "shape": list(p.tensor.shape)})
    json_name, tensor_name = state_files(rank)
    state_ref = {"json": json_name, "tensors": None}
    if job["state_tensors"]:
        keys = list(job["state_tensors"])
        ts = [job["state_tensors"][k] for k in keys]
        from distrun_safetensors.pieces import safetensors_dtype

        entries = [(k, safetensors_dtype(t.dtype), list(t.shape), t.numel() * t.element_size())
                   for k, t in zip(keys, ts, strict=False)]
        current.append(os.path.join(tmp, tensor_name))
        files[tensor_name] = write_safetensors(current[-1], entries,
                                               (tensor_bytes(t) for t in ts))
        state_ref["tensors"] = tensor_name
    current.append(os.path.join(tmp, json_name))
    files[json_name] = write_json(current[-1], job["state_json"])
    for info in files.values():
        info["rank"] = rank
    return {"files": files, "pieces": described, "state_files": state_ref}
