"""Where the model is cut into stages, and the per-stage modules that run its own forward.

The model's forward is not traced or rewritten. Every stage calls the model's own
``forward``, on a copy of the module tree (the modules along the path to the blocks are
shallow copies; the blocks themselves are shared) in which the modules of other stages are
replaced by parameter-free stand-ins:

- a stand-in *after* the stage's last module ends the forward: its input is the stage's
  output (the next stage receives it);
- the stand-in right *before* the stage's first module returns the activation received from
  the previous stage; earlier stand-ins return zeros shaped like that activation (what they
  compute is dropped).

So the forward must pass one hidden-state tensor through the blocks one after the other. Every
stage calls it with the batch's own input (the received activation enters at the stand-in), so
what it does before the first block may read the input freely, but not the values of what the
skipped modules return (zeros shaped like the activation). Embeddings and whatever is registered
before the blocks go to the first stage; norms, heads and whatever is registered after them to
the last. Modules around the blocks that hold no state (no parameters, no persistent buffers:
a Hugging Face model's rotary embedding, a dropout) are not cut at all: every stage runs them,
wherever the forward calls them.

The last stage's output crosses into torch's schedule, which takes tensors: a mapping output
with one tensor among its values (a ``transformers`` ``ModelOutput`` holding ``logits``, the
non-tensor cache dropped) hands on that tensor, and :meth:`StageModule.as_model_output` puts it
back in the same mapping type for the task's loss and evaluation steps.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from distrun.plugin import UsageError

__all__ = ["Chain", "StageModule", "balance", "find_chain", "split_table", "stage_tree"]

DECLARE = ("declare the split: give the task `pipeline_split_points = ['blocks.4', ...]` "
           "(names of sibling modules the hidden state flows through in order, each starting "
           "a stage)")


@dataclass
class Chain:
    """The model as an ordered list of modules: ``pre`` + ``blocks`` + ``post`` (names);
    ``shared``: the stateless modules around the blocks, which every stage keeps."""

    pre: list[str]
    blocks: list[str]
    post: list[str]
    container: str
    shared: list[str] = field(default_factory=list)

    @property
    def order(self) -> list[str]:
        return [*self.pre, *self.blocks, *self.post]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _stateless(module: nn.Module) -> bool:
    """No parameters and no persistent buffers: nothing to own, the same in every stage."""
    if any(True for _ in module.parameters()):
        return False
    return not any(key not in mod._non_persistent_buffers_set
                   for mod in module.modules() for key, b in mod._buffers.items()
                   if b is not None)


def _chain_of(model: nn.Module, container: str) -> Chain:
    """Blocks = the container's children; pre/post = siblings along the path, by registration."""
    pre: list[str] = []
    post: list[str] = []
    parts = container.split(".") if container else []
    module, prefix = model, ""
    for part in parts:
        names = list(module._modules)
        at = names.index(part)
        pre += [_join(prefix, n) for n in names[:at] if module._modules[n] is not None]
        post = [_join(prefix, n) for n in names[at + 1:] if module._modules[n] is not None] + post
        if module._parameters and any(p is not None for p in module._parameters.values()):
            raise UsageError(f"pipeline: {type(module).__name__} holds parameters of its own "
                             f"({', '.join(module._parameters)}) next to the blocks; move them "
                             "into a submodule (an embedding, a head) so one stage owns them")
        module = module._modules[part]  # type: ignore[assignment]
        prefix = _join(prefix, part)
    blocks = [_join(container, n) for n, m in module._modules.items() if m is not None]
    shared = [n for n in [*pre, *post] if _stateless(model.get_submodule(n))]
    return Chain(pre=[n for n in pre if n not in shared], blocks=blocks,
                 post=[n for n in post if n not in shared], container=container, shared=shared)


def find_chain(model: nn.Module, split_points: Sequence[str] | None = None) -> Chain:
    """The chain of ``model``: around the declared split points, the model itself when it is
    an ``nn.Sequential``, else its ``ModuleList`` holding the most parameters."""
    if split_points:
        parents = {p.rpartition(".")[0] for p in split_points}
        if len(parents) != 1:
            raise UsageError(f"pipeline_split_points {list(split_points)} are not siblings: "
                             "they must be children of one module (e.g. 'blocks.2', 'blocks.5')")
        parent = parents.pop()
        try:
            model.get_submodule(parent)
            for p in split_points:
                model.get_submodule(p)
        except AttributeError as exc:
            raise UsageError(f"pipeline_split_points: {exc} in {type(model).__name__}") from None
        return _chain_of(model, parent)
    if isinstance(model, nn.Sequential):
        return _chain_of(model, "")
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise UsageError(f"pipeline cannot split {type(model).__name__}: it is not an "
                         f"nn.Sequential and has no nn.ModuleList of blocks; {DECLARE}")
    name, _ = max(lists, key=lambda nm: _params(nm[1]))
    return _chain_of(model, name)


def balance(weights: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """Contiguous ranges of ``weights`` in ``parts`` (each non-empty) with the smallest
    largest sum (linear partition, exact: the chains are short)."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: smallest max-sum splitting the first i items into k parts
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n - parts + k + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    ranges, i = [], n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        ranges.append((j, i))
        i = j
    return ranges[::-1]


def plan(model: nn.Module, chain: Chain, stages: int,
         split_points: Sequence[str] | None = None) -> list[tuple[int, int]]:
    """Per stage, its range in ``chain.order`` (pre modules on the first, post on the last)."""
    nb = len(chain.blocks)
    if stages > nb:
        raise UsageError(f"pipeline: {stages} stages but {type(model).__name__} has only {nb} "
                         f"blocks in {chain.container or 'the model'} (use --pp and "
                         f"--pp-virtual-stages with stages <= {nb})")
    if split_points:
        starts = [chain.blocks.index(p) for p in split_points]
        if len(starts) != stages - 1 or starts != sorted(set(starts)) or 0 in starts:
            raise UsageError(f"pipeline_split_points gives {len(split_points) + 1} stages "
                             f"({list(split_points)}), the run has {stages}; give {stages - 1} "
                             "increasing names after the first block")
        bounds = [0, *starts, nb]
        block_ranges = list(zip(bounds[:-1], bounds[1:], strict=True))
    else:
        weights = [_params(model.get_submodule(b)) or 1 for b in chain.blocks]
        weights[0] += sum(_params(model.get_submodule(p)) for p in chain.pre)
        weights[-1] += sum(_params(model.get_submodule(p)) for p in chain.post)
        block_ranges = balance(weights, stages)
    npre = len(chain.pre)
    out = [(lo + npre, hi + npre) for lo, hi in block_ranges]
    out[0] = (0, out[0][1])
    out[-1] = (out[-1][0], len(chain.order))
    return out


def split_table(model: nn.Module, chain: Chain, ranges: list[tuple[int, int]],
                placement: list[int]) -> str:
    """The split as text: stage -> rank -> modules -> parameters."""
    order = chain.order
    lines = []
    for s, (lo, hi) in enumerate(ranges):
        names = order[lo:hi]
        blocks = [n for n in names if n in chain.blocks]
        extra = [n for n in names if n not in chain.blocks]
        shown = (f"{blocks[0]}..{blocks[-1].rpartition('.')[2]}" if len(blocks) > 1
                 else blocks[0]) if blocks else ""
        what = ", ".join([*[e for e in extra if e in chain.pre], shown,
                          *[e for e in extra if e in chain.post]])
        count = sum(_params(model.get_submodule(n)) for n in names)
        lines.append(f"  stage {s} (pp rank {placement[s]}): {what}: {count:,} parameters")
    return "\n".join(lines)


class _StageOutput(Exception):  # noqa: N818 (control flow, not an error)
    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value


class _Slot:
    """The activation a stage received, read by the stand-in before its first module."""

    h: Any = None


class _Absent(nn.Module):
    """A module of another stage: enters, skips or ends this stage's forward (no state)."""

    _slot: _Slot

    def __init__(self, role: str, slot: _Slot) -> None:
        super().__init__()
        self.role = role
        object.__setattr__(self, "_slot", slot)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.role == "enter":
            return self._slot.h
        if self.role == "skip":  # zeros shaped like the activation, without memory of its own
            h = self._slot.h
            if isinstance(h, torch.Tensor):
                return torch.zeros((), dtype=h.dtype, device=h.device).expand(h.shape)
            return torch.zeros(())
        value = args[0] if args else next(iter(kwargs.values()))
        raise _StageOutput(value)

    def extra_repr(self) -> str:
        return self.role


def _rebuild(module: nn.Module, prefix: str, replace: dict[str, nn.Module]) -> nn.Module:
    new = copy.copy(module)
    new.__dict__["_modules"] = type(module._modules)(module._modules)
    for name, child in module._modules.items():
        fqn = _join(prefix, name)
        if fqn in replace:
            new._modules[name] = replace[fqn]
        elif child is not None and any(k.startswith(fqn + ".") for k in replace):
            new._modules[name] = _rebuild(child, fqn, replace)
    return new


class StageModule(nn.Module):
    """One stage: the model's forward over a tree holding only this stage's modules."""

    _slot: _Slot

    def __init__(self, tree: nn.Module, first: bool, slot: _Slot, names: list[str]) -> None:
        super().__init__()
        self.tree = tree
        self.first = first
        self.names = names
        object.__setattr__(self, "_slot", slot)
        #: (mapping type, key) when the model's forward returned a mapping (the last stage)
        self.form: tuple[type, str] | None = None

    def forward(self, *args: Any, stage_input: Any = None, **kwargs: Any) -> Any:
        """``args[0]``: the batch's input (first stage) or the received activation (others,
        which get the batch's input as ``stage_input``)."""
        if not self.first:
            self._slot.h = args[0]
            if stage_input is not None:  # the model's forward reads the batch's own input
                args = (stage_input, *args[1:])
        try:
            return self._tensor_of(self.tree(*args, **kwargs))
        except _StageOutput as out:
            return out.value
        finally:
            self._slot.h = None

    def _tensor_of(self, out: Any) -> Any:
        """A mapping output (a ``ModelOutput``) as its one tensor: the schedule takes tensors."""
        if not isinstance(out, Mapping):
            return out
        tensors = [(k, v) for k, v in out.items() if isinstance(v, torch.Tensor)]
        if len(tensors) != 1:
            raise UsageError(
                f"pipeline: the model's forward returned a {type(out).__name__} with "
                f"{len(tensors)} tensors ({', '.join(k for k, _ in tensors) or 'none'}); the "
                "last stage hands on one tensor: return it alone (for a transformers model, "
                "call it without labels= and compute the loss from the logits in the task)")
        self.form = (type(out), tensors[0][0])
        return tensors[0][1]

    def as_model_output(self, value: Any) -> Any:
        """``value`` (the last stage's tensor) in the mapping type the model returned, if any."""
        if self.form is None or not isinstance(value, torch.Tensor):
            return value
        cls, key = self.form
        return cls(**{key: value})


def stage_tree(model: nn.Module, chain: Chain, lo: int, hi: int) -> StageModule:
    """The module of the stage owning ``chain.order[lo:hi]`` (shares those modules)."""
    order = chain.order
    slot = _Slot()
    replace: dict[str, nn.Module] = {}
    for i, name in enumerate(order):
        if lo <= i < hi:
            continue
        role = "exit" if i >= hi else ("enter" if i == lo - 1 else "skip")
        replace[name] = _Absent(role, slot)
    tree = _rebuild(model, "", replace)
    return StageModule(tree, lo == 0, slot, order[lo:hi])
