"""``--activation-checkpointing CLASS[,CLASS]``: recompute the activations of those submodules
in the backward pass instead of keeping them (less memory, one more forward of each)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from distrun._spec.errors import UsageError

__all__ = ["apply_activation_checkpointing"]


def apply_activation_checkpointing(model: torch.nn.Module, names: str) -> int:
    """Checkpoint every submodule whose class name is in ``names`` (comma-separated); the
    count. The module's own ``forward`` is wrapped in place, so parameter names and
    checkpoints stay as they were (no wrapper module)."""
    wanted = {n.strip() for n in names.split(",") if n.strip()}
    if not wanted:
        return 0
    found = [m for m in model.modules() if type(m).__name__ in wanted and m is not model]
    missing = wanted - {type(m).__name__ for m in found}
    if missing:
        classes = sorted({type(m).__name__ for m in model.modules()})
        raise UsageError(f"--activation-checkpointing {', '.join(sorted(missing))}: no "
                         f"submodule of that class in the model (its classes: "
                         f"{', '.join(classes)})")
    for module in found:
        module.forward = functools.partial(_checkpointed, module.forward)
    return len(found)


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():  # evaluation: nothing to save
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
