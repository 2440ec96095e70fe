"""``Models``: several models in one run, each wrapped by the strategy on its own.

A GAN trains a generator and a discriminator with their own optimizers. Wrapped together as one
module, DDP would sync them as one (and only through the container's ``forward``, which a GAN
never calls); so ``configure_model()`` returns ``distrun.Models(generator=G, discriminator=D)``
and the strategy wraps each value separately (DDP: one ``DistributedDataParallel`` each; FSDP:
each sharded as its own root). The steps get the container and call ``model.generator(z)``.
Checkpoints and summaries see the unwrapped models under their names (``generator.*``), so a
checkpoint saved under one strategy loads under another.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

__all__ = ["Models", "compile_model", "no_sync", "params_of", "unwrap", "wrap_model"]


class Models(nn.ModuleDict):
    """Named models the strategy wraps one by one: ``Models(generator=G, discriminator=D)``.

    Read them as attributes (``model.generator``) or items (``model["generator"]``).
    """

    def __init__(self, models: Any = None, **named: nn.Module) -> None:
        super().__init__({**dict(models or {}), **named})

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"distrun.Models has no forward of its own: call one of its models "
                        f"({', '.join(f'model.{n}(...)' for n in self)})")


def wrap_model(strategy: Any, model: nn.Module) -> nn.Module:
    """``strategy.wrap_model`` of the model, or of each of a :class:`Models`' models."""
    if not isinstance(model, Models):
        return strategy.wrap_model(model)
    for name, child in list(model.items()):
        model[name] = strategy.wrap_model(child)
    return model


def unwrap(strategy: Any, model: nn.Module) -> nn.Module:
    """The user's module(s) without wrappers: for :class:`Models`, a new container of each
    unwrapped model (the same modules and parameters, named as the task named them)."""
    if not isinstance(model, Models):
        return strategy.unwrap_model(model)
    return Models({name: strategy.unwrap_model(child) for name, child in model.items()})


def no_sync(strategy: Any, model: nn.Module) -> AbstractContextManager[Any]:
    """The strategy's ``no_sync`` of the model, or of each model of a :class:`Models`."""
    if not isinstance(model, Models):
        return strategy.no_sync(model)
    stack = contextlib.ExitStack()
    for child in model.values():
        stack.enter_context(strategy.no_sync(child))
    return stack


def compile_model(strategy: Any, model: nn.Module) -> None:
    """torch.compile in place, through the strategy's ``compile_model`` (what runs the steps:
    the model itself, or a pipeline's stage modules): of the model, or of each of a
    :class:`Models`' (the container has no forward of its own)."""
    compile_one = getattr(strategy, "compile_model", None) or _compile_in_place
    targets = list(model.values()) if isinstance(model, Models) else [model]
    for target in targets:
        compile_one(target)


def _compile_in_place(model: nn.Module) -> None:
    model.compile()


def params_of(optimizer: Any) -> nn.Module:
    """A module whose ``parameters()`` are ``optimizer``'s: what a strategy's
    ``clip_grad_norm(model, max_norm)`` clips when one of several optimizers steps."""
    return _Params([p for g in optimizer.param_groups for p in g["params"]])


class _Params(nn.Module):
    """Parameters owned elsewhere, listed (not registered: the owner's state_dict keeps them)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        super().__init__()
        self._listed = params

    def parameters(self, recurse: bool = True) -> Any:
        return iter(self._listed)
