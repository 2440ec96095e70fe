"""Contributed state as data: JSON for values, a safetensors file for tensors. No pickle.

``encode`` turns nested dicts/lists/tuples of JSON values and tensors into JSON, moving each
tensor into ``tensors`` under its path. Tuples and dicts with non-string keys are tagged so
they come back as they were. Anything else is refused with the path of the offending value.
"""

from __future__ import annotations

from typing import Any

from distrun_safetensors.files import CheckpointError

__all__ = ["decode", "encode"]

_TAGS = ("__tensor__", "__tuple__", "__dict__", "__inline__")


def encode(value: Any, path: str, tensors: dict[str, Any] | None) -> Any:
    """JSON-able form of ``value``; tensors go to ``tensors`` (or inline when it is None)."""
    import torch

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if type(t) is not torch.Tensor:
            t = t.full_tensor() if hasattr(t, "full_tensor") else t
        t = t.cpu()
        if tensors is None:
            return {"__inline__": {"dtype": str(t.dtype).removeprefix("torch."),
                                   "shape": list(t.shape), "data": t.reshape(-1).tolist()}}
        tensors[path] = t.contiguous().clone()
        return {"__tensor__": path}
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, f"{path}.{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, f"{path}.{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) and k not in _TAGS for k in value):
            return {k: encode(v, f"{path}.{k}", tensors) for k, v in value.items()}
        return {"__dict__": [[encode(k, f"{path}.<key>", None), encode(v, f"{path}.{k}", tensors)]
                             for k, v in value.items()]}
    try:
        import numpy as np

        if isinstance(value, np.generic):
            return value.item()
    except ImportError:  # pragma: no cover
        pass
    raise CheckpointError(
        f"checkpoint state {path!r} is a {type(value).__name__}, which is neither a JSON value "
        "nor a tensor (return plain data from state_dict)")


def decode(value: Any, tensors: Any) -> Any:
    """Invert :func:`encode`; ``tensors`` maps keys to tensors (``get_tensor``-like)."""
    if isinstance(value, list):
        return [decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        (tag, inner), = value.items()
        if tag == "__tensor__":
            return tensors(inner)
        if tag == "__tuple__":
            return tuple(decode(v, tensors) for v in inner)
        if tag == "__dict__":
            return {decode(k, tensors): decode(v, tensors) for k, v in inner}
        if tag == "__inline__":
            import torch

            dtype = getattr(torch, inner["dtype"])
            return torch.tensor(inner["data"], dtype=dtype).reshape(inner["shape"])
    return {k: decode(v, tensors) for k, v in value.items()}
