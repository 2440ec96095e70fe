"""Several optimizers: what ``configure_optimizers`` may return, and the run's one view of them.

A task that trains several models with their own optimizers (a GAN's generator and
discriminator) defines Lightning's ``configure_optimizers(model)`` (or ``configure_optimizers()``
without the model, when the task kept its modules) and returns:

- an optimizer, or a list or tuple of them;
- ``([optimizers], [schedulers])``: two lists, as Lightning accepts;
- ``{"optimizer": o, "lr_scheduler": s}``, or a list of such dicts (a scheduler may be a
  scheduler dict: ``interval``, ``frequency``, ``monitor``...; see :mod:`.schedulers`).

Several optimizers need manual optimization (``automatic_optimization = False``: the task
steps each one in ``training_step``, see :mod:`.manual`), as in Lightning 2. The run holds them
as one :class:`OptimizerGroup` (``run.optimizer``): its ``param_groups`` are every optimizer's
groups in order and its ``state_dict`` every optimizer's state, so a checkpoint (and a plugin
that reads ``run.optimizer``) saves and restores all of them, each parameter's state under its
name in the model.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch

from distrun._spec.errors import UsageError

__all__ = ["OptimizerGroup", "build_optimizers", "check_manual", "inner_optimizers",
           "is_manual", "wrap_optimizers"]


class OptimizerGroup:
    """Several optimizers seen as one: ``param_groups``, ``state`` and ``(load_)state_dict``
    span all of them in order; ``step`` and ``zero_grad`` act on each."""

    def __init__(self, optimizers: list[Any]) -> None:
        self.optimizers = list(optimizers)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def state(self) -> dict[Any, Any]:
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    def step(self, closure: Any = None) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """torch's layout over all the optimizers: parameters numbered across them in order."""
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        offset = 0
        for opt in self.optimizers:
            sd = opt.state_dict()
            for index, values in sd["state"].items():
                state[offset + int(index)] = values
            for group in sd["param_groups"]:
                groups.append({**group, "params": [offset + int(i) for i in group["params"]]})
            offset += sum(len(g["params"]) for g in sd["param_groups"])
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Split a :meth:`state_dict` back: each optimizer takes as many groups as it has."""
        groups, state = list(state_dict["param_groups"]), state_dict["state"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"the state holds {len(groups)} parameter groups, the optimizers "
                             f"have {len(self.param_groups)}")
        start = 0
        for opt in self.optimizers:
            mine, start = groups[start:start + len(opt.param_groups)], start + len(
                opt.param_groups)
            local: dict[int, int] = {}
            renumbered = []
            for group in mine:
                ids = []
                for index in group["params"]:
                    local[int(index)] = len(local)
                    ids.append(local[int(index)])
                renumbered.append({**group, "params": ids})
            opt.load_state_dict({"state": {local[int(i)]: v for i, v in state.items()
                                           if int(i) in local},
                                 "param_groups": renumbered})

    def __repr__(self) -> str:
        return f"OptimizerGroup({', '.join(type(o).__name__ for o in self.optimizers)})"


def inner_optimizers(optimizer: Any) -> list[Any]:
    """The run's optimizers as a list (one, or each of a group's)."""
    if optimizer is None:
        return []
    return list(optimizer.optimizers) if isinstance(optimizer, OptimizerGroup) else [optimizer]


def wrap_optimizers(strategy: Any, optimizer: Any) -> Any:
    """The strategy's ``wrap_optimizer`` of each optimizer."""
    if isinstance(optimizer, OptimizerGroup):
        optimizer.optimizers = [strategy.wrap_optimizer(o) for o in optimizer.optimizers]
        return optimizer
    return strategy.wrap_optimizer(optimizer)


def is_manual(task: Any) -> bool:
    """The task steps its optimizers itself (Lightning's ``automatic_optimization = False``)."""
    return getattr(task, "automatic_optimization", True) is False


def _is_optimizer(value: Any) -> bool:
    return isinstance(value, torch.optim.Optimizer) or (
        callable(getattr(value, "step", None)) and callable(getattr(value, "zero_grad", None))
        and hasattr(value, "param_groups"))


def _split(made: Any, where: str) -> tuple[list[Any], list[Any]]:
    """(optimizers, schedulers) of what ``configure_optimizers`` returned."""
    if _is_optimizer(made):
        return [made], []
    if isinstance(made, Mapping):
        made = [made]
    if isinstance(made, (list, tuple)) and len(made) == 2 \
            and all(isinstance(part, (list, tuple)) for part in made):
        return list(made[0]), list(made[1])  # ([optimizers], [schedulers])
    if isinstance(made, (list, tuple)) and made:
        optimizers, schedulers = [], []
        for item in made:
            if isinstance(item, Mapping):
                if "optimizer" not in item:
                    raise UsageError(f"{where} returned a dict without 'optimizer' (keys "
                                     f"{', '.join(map(repr, list(item)[:5]))}); each dict is "
                                     "{'optimizer': o, 'lr_scheduler': s}")
                optimizers.append(item["optimizer"])
                if item.get("lr_scheduler") is not None:
                    schedulers.append(item["lr_scheduler"])
            else:
                optimizers.append(item)
        return optimizers, schedulers
    raise UsageError(f"{where} returned {type(made).__name__} {str(made)[:40]!r}; return an "
                     "optimizer, a list of them, ([optimizers], [schedulers]) or "
                     "{'optimizer': o, 'lr_scheduler': s} dicts")


def build_optimizers(run: Any) -> None:
    """``run.optimizer`` and ``run.lr_scheduler`` from the task's ``configure_optimizers``."""
    configure = run.task.configure_optimizers
    where = f"{type(run.task).__name__}.configure_optimizers()"
    takes_model = any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                      for p in inspect.signature(configure).parameters.values())
    optimizers, schedulers = _split(configure(run.model) if takes_model else configure(), where)
    for i, opt in enumerate(optimizers):
        if not _is_optimizer(opt):
            raise UsageError(f"{where}: item {i} is a {type(opt).__name__}, not an optimizer "
                             "(a torch.optim.Optimizer, e.g. torch.optim.Adam(model.g.parameters()))")
    if not optimizers:
        raise UsageError(f"{where} returned no optimizer")
    if len(optimizers) > 1 and not is_manual(run.task):
        raise UsageError(f"{where} returned {len(optimizers)} optimizers: several optimizers "
                         "need manual optimization; set `automatic_optimization = False` on "
                         "the task and step each in training_step (self.optimizers(), "
                         "self.manual_backward(loss))")
    run.optimizer = optimizers[0] if len(optimizers) == 1 else OptimizerGroup(optimizers)
    if schedulers and run.lr_scheduler is None:
        run.lr_scheduler = schedulers


def check_manual(run: Any) -> None:
    """What manual optimization cannot do, refused before training starts."""
    if is_manual(run.task) and run.config.grad_accum > 1:
        raise UsageError(f"--grad-accum {run.config.grad_accum}: {type(run.task).__name__} "
                         "steps its optimizers itself (automatic_optimization = False), so "
                         "gradient accumulation is its own to do; drop --grad-accum (or "
                         "grad_accum=) and accumulate in training_step")
