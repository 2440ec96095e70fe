"""The DeepSpeed engine's sharded state, seen per parameter as distrun's checkpoints need it.

ZeRO keeps the optimizer state (and under stage 3 the weights) as flat partitions, one slice
per rank. DeepSpeed's tensor-fragment API (``deepspeed.utils.safe_get_full_*`` and
``safe_set_full_*``) reads and writes one parameter's whole value across those partitions;
every rank calls it for every parameter in the same order, since it gathers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["FullWeights", "ZeroOptimizerView"]


def _per_parameter(value: Any) -> bool:
    """Whether an optimizer state entry is a tensor shaped like its parameter (not ``step``)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0


class ZeroOptimizerView:
    """The engine's optimizer in ``torch.optim``'s terms: the task's parameters and groups,
    whole per-parameter state with global indices (``state_dict`` is collective).

    ``base`` is the task's optimizer, which the engine steps (its groups now hold the flat
    partitions; learning-rate schedulers built on it keep working); ``groups`` are the task's
    parameters of each group, captured before the engine flattened them.
    """

    def __init__(self, engine: Any, base: torch.optim.Optimizer,
                 groups: list[list[torch.nn.Parameter]]) -> None:
        self._engine = engine
        self._base = base
        self._groups = groups

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [{**{k: v for k, v in group.items() if k != "params"}, "params": params}
                for group, params in zip(self._base.param_groups, self._groups, strict=True)]

    @property
    def defaults(self) -> dict[str, Any]:
        return self._base.defaults

    def _flat_state(self, index: int) -> list[dict[str, Any]]:
        """The engine's state entries of group ``index`` (one per flat partition).

        ZeRO-3 keeps its partitions out of the groups between steps: there, every entry.
        """
        state = self._base.state
        mine = [state[flat] for flat in self._base.param_groups[index]["params"]
                if flat in state]
        return mine or list(state.values())

    def state_dict(self) -> dict[str, Any]:
        """Every parameter's whole state, ``torch.optim`` format; every rank must call it."""
        from deepspeed.utils import safe_get_full_optimizer_state

        state: dict[int, dict[str, Any]] = {}
        groups, index = [], 0
        for g, params in enumerate(self._groups):
            flats = self._flat_state(g)
            template = flats[0] if flats else {}
            for p in params:
                entry: dict[str, Any] = {}
                for key, value in template.items():
                    if _per_parameter(value):
                        full = safe_get_full_optimizer_state(p, key)  # gathers
                        shape = getattr(p, "ds_shape", p.shape)  # ZeRO-3: the whole shape
                        entry[key] = full.detach().to("cpu", copy=True).reshape(shape)
                    else:
                        entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
                if entry:
                    state[index] = entry
                index += 1
            hyper = {k: v for k, v in self._base.param_groups[g].items() if k != "params"}
            groups.append({**hyper, "params": list(range(index - len(params), index))})
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take a whole ``torch.optim`` state (any world size wrote it); every rank calls it."""
        from deepspeed.utils import safe_set_full_optimizer_state

        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self._groups):
            raise ValueError(f"the checkpoint's optimizer has {len(saved_groups)} parameter "
                             f"groups, this one {len(self._groups)}")
        for group, saved in zip(self._base.param_groups, saved_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        saved_state = {int(k): v for k, v in state_dict["state"].items()}
        self._materialize(saved_state)
        # ZeRO 1/2 link each parameter to its slice of the optimizer state after the first
        # step; a resume writes that state before any step, so link it now (idempotent)
        link = getattr(self._engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
        if link is not None:
            link()
        index = 0
        for g, params in enumerate(self._groups):
            flats = self._flat_state(g)
            for p in params:
                for key, value in saved_state.get(index, {}).items():
                    if _per_parameter(value):
                        safe_set_full_optimizer_state(p, value.to(torch.float32), key)
                    else:  # one value per flat partition (Adam's step): the same for all
                        for flat in flats:
                            flat[key] = value.clone() if isinstance(value, torch.Tensor) \
                                else value
                index += 1

    def _materialize(self, saved: dict[int, dict[str, Any]]) -> None:
        """Create the flat state entries a resume writes into, where no step made them yet.

        ZeRO 1/2 leave the task optimizer's state empty until its first step (torch optimizers
        create it lazily); the saved entries say which keys it has: a zero tensor shaped like
        the flat partition for each per-parameter one, the saved value for the others (one
        optimizer class: every group has the same keys).
        """
        keys: dict[str, Any] = {}
        for entry in saved.values():
            keys.update(entry)
        flats = [flat for group in self._base.param_groups for flat in group["params"]]
        # ZeRO-3 keeps its fp32 partitions out of the groups between steps
        flats += getattr(self._engine.optimizer, "fp32_partitioned_groups_flat", [])
        for flat in flats:
            entry = self._base.state[flat]  # a defaultdict: created on first access
            for key, value in keys.items():
                if key in entry:
                    continue
                if _per_parameter(value):
                    entry[key] = torch.zeros_like(flat, memory_format=torch.preserve_format)
                else:
                    entry[key] = value.clone() if isinstance(value, torch.Tensor) else value

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._engine.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("the DeepSpeed engine's step takes no closure")
        self._engine.step()

    def __repr__(self) -> str:
        inner = type(self._engine.optimizer).__name__
        return f"ZeroOptimizerView({type(self._base).__name__} in {inner})"


class FullWeights(torch.nn.Module):
    """A ZeRO-3 module's whole weights for checkpoints (gathered from the shards).

    ``state_dict()`` returns whole copies; whatever a loader then writes into those copies goes
    back into the shards with :meth:`write_back`. Other attribute reads go to the module.
    """

    _target: torch.nn.Module
    _copies: dict[str, torch.Tensor] | None

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_target", module)  # not a child: its keys stay unprefixed
        object.__setattr__(self, "_copies", None)

    def _gathered(self, modifier_rank: int | None) -> Any:
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self._target.parameters()),
                                                 modifier_rank=modifier_rank)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        with self._gathered(None):
            copies = {k: v.detach().clone() for k, v in self._target.state_dict().items()}
        object.__setattr__(self, "_copies", copies)
        return dict(copies)

    def write_back(self) -> None:
        """Put the last ``state_dict()``'s tensors (as a loader left them) into the shards."""
        copies = self._copies
        if copies is None:
            return
        object.__setattr__(self, "_copies", None)
        with self._gathered(0), torch.no_grad():  # rank 0's values go to every shard
            self._target.load_state_dict(copies)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, Any]]:
        return self._target.named_parameters(*args, **kwargs)

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        return self._target.parameters(recurse)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, Any]]:
        return self._target.named_buffers(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._target(*args, **kwargs)
