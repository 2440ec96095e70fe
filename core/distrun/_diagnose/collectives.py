"""Each collective a rank calls through ``torch.distributed``, marked in its position record.

The worker wraps torch.distributed's collective functions (in ``torch.distributed`` and
``distributed_c10d``, where both the user's ``dist.all_reduce`` and torch's own modules,
FSDP's among them, look them up at each call): the wrapper marks the kind and, for the world
group, the collective's number, calls the function, and clears the mark. A plain torchrun
script's collectives are seen so, and the loop's (the step boundary's vote, metrics,
checkpoints). Not seen: what C++ calls directly (DDP's gradient all-reduce: its wait shows as
"in backward"). An asynchronous collective (``async_op=True``) is marked while it is issued;
its wait shows in the stack.

torch's ``_register_on_completion_hook`` would say when each collective completes, but only
NCCL's process group has it (gloo raises): this wrapper is what works on every backend.
The cost: one Python call and two writes into the record, about a microsecond a collective.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from typing import Any

from distrun._diagnose.position import COLLECTIVES, Recorder

__all__ = ["watch_collectives"]

_DONE = "_distrun_position"  # set on a wrapped function (never wrapped twice)


def _wrap(fn: Any, kind: int, rec: Recorder, world: Any) -> Any:
    @functools.wraps(fn)
    def marked(*args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group")
        if group is None:  # or given by position
            group = next((a for a in args if isinstance(a, _GROUP_TYPES)), None)
        rec.enter(kind, group is None or group is world())
        try:
            return fn(*args, **kwargs)
        finally:
            rec.leave()

    setattr(marked, _DONE, True)
    return marked


_GROUP_TYPES: tuple[type, ...] = ()


def _patch(rec: Recorder) -> None:
    global _GROUP_TYPES
    dist = sys.modules["torch.distributed"]
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    pg = getattr(dist, "ProcessGroup", None)
    _GROUP_TYPES = (pg,) if isinstance(pg, type) else ()

    def world() -> Any:
        return getattr(getattr(dist, "group", None), "WORLD", None)

    for kind, name in enumerate(COLLECTIVES, start=1):
        for module in (dist, c10d):
            fn = getattr(module, name, None) if module is not None else None
            if fn is None or getattr(fn, _DONE, False):
                continue
            setattr(module, name, _wrap(fn, kind, rec, world))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Patches ``torch.distributed`` once it is imported (a script imports it after start)."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "torch.distributed":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader, rec = spec.loader, self.rec

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: Any) -> None:
                loader.exec_module(module)
                _patch(rec)

        spec.loader = _Loader()
        return spec


def watch_collectives(rec: Recorder) -> None:
    """Mark this process's collectives in ``rec``: now if torch.distributed is imported,
    else as soon as it is."""
    if "torch.distributed" in sys.modules:
        _patch(rec)
    else:
        sys.meta_path.insert(0, _AfterImport(rec))
