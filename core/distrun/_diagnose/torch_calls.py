"""The torch calls a rank's position record follows: its collectives, and in a plain script
its backward passes and optimizer steps.

The worker wraps torch.distributed's collective functions (in ``torch.distributed`` and
``distributed_c10d``, where both the user's ``dist.all_reduce`` and torch's own modules,
FSDP's among them, look them up at each call): the wrapper marks the kind and, for the world
group, the collective's number, calls the function, and clears the mark. A plain torchrun
script's collectives are seen so, and the loop's (the step boundary's vote, metrics,
checkpoints). Not seen: what C++ calls directly (DDP's gradient all-reduce: its wait shows as
"in backward"). An asynchronous collective (``async_op=True``) is marked while it is issued;
its wait shows in the stack.

torch's ``_register_on_completion_hook`` would say when each collective completes, but only
NCCL's process group has it (gloo raises: "Only ProcessGroupNCCL supports onCompletion
hook"): this wrapper is what works on every backend. The cost: one Python call and two writes
into the record, about a microsecond a collective.

A plain script has no loop to mark its steps, and DDP's all-reduce is not seen: its steps are
the optimizer's (torch's global optimizer step hooks, public API) and its backward passes
``torch.autograd.backward`` (which ``Tensor.backward`` calls), wrapped as the collectives are.
So a DDP script's rank is "in backward" while it waits for its peers' gradients, and the
step count moves at each ``optimizer.step()``.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from typing import Any

from distrun._diagnose.position import COLLECTIVES, POINT_TO_POINT, Phase, Recorder

__all__ = ["watch_collectives", "watch_script_steps"]

_DONE = "_distrun_position"  # set on a wrapped function (never wrapped twice)


#: whether each process group (by id) spans the world: its collectives are numbered
_SPANS: dict[int, bool] = {}


def _spans_world(group: Any, world: Any) -> bool:
    """Whether ``group`` holds every rank (the world's, or another over the same ranks, as
    FSDP's mesh makes): every rank then counts its collectives alike."""
    if group is None or group is world:
        return True
    spans = _SPANS.get(id(group))
    if spans is None:
        try:
            spans = _SPANS[id(group)] = group.size() == world.size()
        except Exception:  # noqa: BLE001 - a group torch no longer knows: not numbered
            return False
    return spans


def _wrap(fn: Any, kind: int, rec: Recorder, world: Any) -> Any:
    numbered = COLLECTIVES[kind - 1] not in POINT_TO_POINT

    @functools.wraps(fn)
    def marked(*args: Any, **kwargs: Any) -> Any:
        spans = False
        if numbered:
            group = kwargs.get("group")
            if group is None:  # or given by position
                group = next((a for a in args if isinstance(a, _GROUP_TYPES)), None)
            spans = _spans_world(group, world())
        rec.enter(kind, spans)
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
    """Calls ``then()`` once the module ``name`` is imported (a script imports torch after
    the worker starts)."""

    def __init__(self, name: str, then: Callable[[], None]) -> None:
        self.name, self.then = name, then

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader, then = spec.loader, self.then

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: Any) -> None:
                loader.exec_module(module)
                then()

        spec.loader = _Loader()
        return spec


def _after_import(name: str, then: Callable[[], None]) -> None:
    if name in sys.modules:
        then()
    else:
        sys.meta_path.insert(0, _AfterImport(name, then))


def watch_collectives(rec: Recorder, script_steps: bool = False) -> None:
    """Mark this process's collectives in ``rec`` (now if torch.distributed is imported,
    else as soon as it is); ``script_steps``: a plain script's steps and backward passes
    too (:func:`watch_script_steps`, once torch.optim is imported)."""
    _after_import("torch.distributed", lambda: _patch(rec))
    if script_steps:
        _after_import("torch.optim", lambda: watch_script_steps(rec))


def watch_script_steps(rec: Recorder) -> None:
    """In a plain script (torch imported): its optimizer steps are its steps, its backward
    passes a phase; between them it is in the script (see module doc)."""
    import torch
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    steps = [0]

    def pre(optimizer: Any, args: Any, kwargs: Any) -> None:
        if not rec.in_loop:  # (a script that calls distrun.fit: the loop marks its steps)
            rec.phase(Phase.OPTIMIZER)

    def post(optimizer: Any, args: Any, kwargs: Any) -> None:
        if rec.in_loop:
            return
        steps[0] += 1
        rec.step_done(steps[0])
        rec.phase(Phase.SCRIPT)

    register_optimizer_step_pre_hook(pre)
    register_optimizer_step_post_hook(post)
    backward = torch.autograd.backward
    if getattr(backward, _DONE, False):
        return

    @functools.wraps(backward)
    def marked(*args: Any, **kwargs: Any) -> Any:
        if rec.in_loop:
            return backward(*args, **kwargs)
        was = rec.current
        rec.phase(Phase.BACKWARD)
        try:
            return backward(*args, **kwargs)
        finally:
            rec.phase(was)

    setattr(marked, _DONE, True)
    torch.autograd.backward = marked
