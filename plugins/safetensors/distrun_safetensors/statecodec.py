"""Contributed state as data: JSON for values, a safetensors file for tensors. No pickle.

``encode`` turns nested dicts/lists/tuples of JSON values and tensors into JSON, moving each
tensor into ``tensors`` under its path. Tuples and dicts with non-string keys are tagged so
they come back as they were. Anything else is refused with the path of the offending value.
"""

from __future__ import annotations

from typing import Any

from distrun_safetensors.files import CheckpointError

__all__ = ["check_encoded", "decode", "encode"]

#: the JSON values a list may hold as they are (exact types: a subclass takes the long way)
_SCALARS = frozenset({bool, int, float, str, type(None)})
_TAGS = ("__tensor__", "__tuple__", "__dict__", "__inline__")
#: the dtypes an ``__inline__`` tensor may name (``torch.<name>``; complex values are not JSON)
_INLINE_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16", "int64", "int32",
                            "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool"})


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
    if isinstance(value, (list, tuple)):
        if _SCALARS.issuperset(map(type, value)):  # an RNG's state: 625 ints, at every save
            items = list(value)
        else:
            items = [encode(v, f"{path}.{i}", tensors) for i, v in enumerate(value)]
        return {"__tuple__": items} if isinstance(value, tuple) else items
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


def check_encoded(value: Any, where: str, tensors: set[str] | None, source: str | None) -> None:
    """Raise :class:`CheckpointError` unless ``value`` (parsed JSON) is what :func:`encode`
    writes, so that :func:`decode` turns it into data and nothing else: tags of the right
    shape, ``__inline__`` tensors of a known dtype whose data fill their shape, ``__dict__``
    keys that can be keys, and every ``__tensor__`` naming one of ``tensors`` (the keys of the
    safetensors file ``source``; None: this value may not refer to tensors at all).

    Torch-free (``distrun ckpt verify`` runs it).
    """
    try:
        _check(value, "", where, tensors, source)
    except RecursionError:
        raise CheckpointError(f"{where}: nested too deeply to be checkpoint state") from None


def _check(value: Any, at: str, where: str, tensors: set[str] | None,
           source: str | None) -> None:
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{where}: {at[:120] or 'the value'} {what}")

    if isinstance(value, list):
        for i, v in enumerate(value):
            _check(v, f"{at}[{i}]", where, tensors, source)
        return
    if not isinstance(value, dict):
        return  # a JSON scalar
    if len(value) == 1 and next(iter(value)) in _TAGS:
        (tag, inner), = value.items()
        if tag == "__tensor__":
            if not isinstance(inner, str):
                raise bad("is a malformed tensor reference")
            if tensors is None or inner not in tensors:
                held = (f"{source} does not hold" if source is not None
                        else "is not stored (no tensor file goes with this one)")
                raise bad(f"refers to tensor {inner[:120]!r}, which {held}")
        elif tag == "__tuple__":
            if not isinstance(inner, list):
                raise bad("is a malformed tuple")
            _check(inner, at, where, tensors, source)
        elif tag == "__dict__":
            if not isinstance(inner, list) or not all(
                    isinstance(kv, list) and len(kv) == 2 for kv in inner):
                raise bad("is a malformed dict (a list of [key, value] pairs)")
            for i, (k, v) in enumerate(inner):
                if not _key(k):
                    raise bad(f"has a key that cannot be a key ({str(k)[:60]})")
                _check(k, f"{at}.<key {i}>", where, None, None)
                _check(v, f"{at}.<value {i}>", where, tensors, source)
        elif not (isinstance(inner, dict) and set(inner) == {"dtype", "shape", "data"}
                  and inner["dtype"] in _INLINE_DTYPES
                  and isinstance(inner["shape"], list)
                  and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                          for d in inner["shape"])
                  and isinstance(inner["data"], list)
                  and all(isinstance(x, (int, float)) for x in inner["data"])
                  and len(inner["data"]) == _prod(inner["shape"])):
            raise bad("is a malformed inline tensor (dtype, shape and as many numbers)")
        return
    for k, v in value.items():
        _check(v, f"{at}.{k}" if at else str(k), where, tensors, source)


def _key(value: Any) -> bool:
    """Whether ``value`` decodes to something hashable (a dict key)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, dict) and len(value) == 1:
        (tag, inner), = value.items()
        if tag == "__tuple__":
            return isinstance(inner, list) and all(_key(v) for v in inner)
        return tag == "__inline__"
    return False


def _prod(values: list[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out
