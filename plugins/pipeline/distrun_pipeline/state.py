"""Global names in checkpoints: placeholders for other stages' tensors, owned ones marked.

A rank of a pipeline holds the parameters of its own stages only. Its view of the model keeps
the whole module tree, and each tensor of another rank's stage becomes a placeholder: a
``DTensor`` of the right global shape and dtype on a mesh of the ranks that do hold it (so
this rank holds no element of it). The tensors this rank owns are presented in ``state_dict``
as ``DTensor``s replicated over its stage's data-parallel ranks (FSDP's are already sharded
ones). So a checkpoint writer that follows DTensor placements (distrun-safetensors) writes
every tensor exactly once, from the ranks that hold it, under its global name, and a reader
reads into each rank only what it holds: no change to the checkpoint format.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from distrun.plugin import UsageError

__all__ = ["is_placeholder", "place_holders", "shared_optimizer_state", "shared_state_dict"]


def placeholder(shape: Any, dtype: torch.dtype, mesh: DeviceMesh,
                device: Any = "cpu") -> DTensor:
    """A tensor of this shape and dtype of which ranks outside ``mesh`` hold nothing."""
    shape = torch.Size(shape)
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    empty = torch.empty(0, dtype=dtype, device=device)
    return DTensor.from_local(empty, mesh, [Replicate()], run_check=False, shape=shape,
                              stride=tuple(reversed(stride)))


def is_placeholder(t: Any) -> bool:
    return isinstance(t, DTensor) and t.device_mesh.get_coordinate() is None


def place_holders(model: nn.Module, absent: dict[str, DeviceMesh],
                  tied: dict[int, DeviceMesh] | None = None) -> None:
    """Replace the parameters and persistent buffers of the modules named in ``absent`` by
    placeholders on the given meshes (their memory is freed). A parameter tied across stages
    (``tied``: its id -> the mesh of every rank holding it) stays whole where a module this
    rank runs uses it, and is a placeholder on that mesh elsewhere."""
    tied = tied or {}
    kept = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)
            if not any(n.startswith(a + ".") for a in absent)}
    done: dict[int, nn.Parameter] = {}
    for name, mesh in absent.items():
        for mod_name, mod in model.get_submodule(name).named_modules(prefix=name):
            for key, p in list(mod._parameters.items()):
                if p is None:
                    continue
                if id(p) in kept:
                    if id(p) in tied:
                        continue  # this rank holds it: a module it runs uses it too
                    raise UsageError(
                        f"pipeline: {mod_name}.{key} is the same parameter as {kept[id(p)]} "
                        "(tied weights) but they fall in different stages; untie them, or "
                        "declare pipeline_split_points that keep both in one stage")
                if id(p) not in done:
                    on = tied.get(id(p), mesh)
                    done[id(p)] = nn.Parameter(placeholder(p.shape, p.dtype, on, p.device),
                                               requires_grad=p.requires_grad)
                mod._parameters[key] = done[id(p)]
            for key, b in list(mod._buffers.items()):
                if b is not None and key not in mod._non_persistent_buffers_set:
                    mod._buffers[key] = placeholder(b.shape, b.dtype, mesh, b.device)


def _mark_owned(value: Any, mesh: DeviceMesh) -> Any:
    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
        return DTensor.from_local(value, mesh, [Replicate()], run_check=False)
    return value


def shared_state_dict(model: nn.Module, mesh: DeviceMesh,
                      tied: dict[str, DeviceMesh] | None = None) -> None:
    """``model.state_dict()`` gives this rank's plain tensors as replicated over ``mesh``, a
    weight tied across stages (``tied``: by name) over the mesh of every rank holding it."""
    tied = tied or {}

    def post(module: nn.Module, state: dict[str, Any], prefix: str, meta: Any) -> None:
        for key, value in state.items():
            state[key] = _mark_owned(value, tied.get(key, mesh))

    model.register_state_dict_post_hook(post)


def shared_optimizer_state(optimizer: torch.optim.Optimizer, mesh: DeviceMesh,
                           tied: dict[int, DeviceMesh] | None = None) -> None:
    """``optimizer.state_dict()``: owned state marked as above, and entries for the other
    stages' parameters (placeholders shaped like this rank's own state), so the state of every
    parameter is described once, whichever rank writes the description."""

    tied = tied or {}

    def post(opt: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
        params = [p for g in opt.param_groups for p in g["params"]]
        template = None
        for i, entry in sd["state"].items():
            p = params[i]
            if is_placeholder(p):
                # state a load gave a placeholder (a scalar `step` is read whole): not ours
                sd["state"][i] = {k: placeholder(v.shape, v.dtype, p.device_mesh, p.device)
                                  if isinstance(v, torch.Tensor) and not is_placeholder(v)
                                  else v for k, v in entry.items()}
                continue
            if template is None:
                template = (params[i], entry)
            on = tied.get(id(p), mesh)
            sd["state"][i] = {k: _mark_owned(v, on) for k, v in entry.items()}
        if template is not None:
            own, entry = template
            for i, p in enumerate(params):
                if i in sd["state"] or not is_placeholder(p):
                    continue
                mirrored = {}
                for k, v in entry.items():
                    if not isinstance(v, torch.Tensor):
                        mirrored[k] = v
                    elif v.dim() == 0:
                        mirrored[k] = placeholder((), v.dtype, p.device_mesh, p.device)
                    elif tuple(v.shape) == tuple(own.shape):
                        mirrored[k] = placeholder(p.shape, v.dtype, p.device_mesh, p.device)
                sd["state"][i] = mirrored
        sd["state"] = dict(sorted(sd["state"].items()))
        return sd

    optimizer.register_state_dict_post_hook(post)
