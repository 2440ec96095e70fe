"""The tensor-parallel plan (the task's, or an automatic one) and applying it to a model.

The automatic plan finds, in every module, a pair of direct ``Linear`` children that form an
MLP or attention block: layers that read the block's input (column-wise: each rank computes a
slice of the hidden features or heads) followed by one layer that maps those features back
(row-wise: partial sums all-reduced). Anything else stays replicated. The model's forward must
not hard-code the full head count in reshapes (use ``view(B, T, -1, head_dim)``).
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from distrun.plugin import UsageError
from distrun_tp.options import TpOptions

__all__ = ["auto_plan", "find_pairs", "parallelize"]

_NORMS = tuple(c for c in (nn.LayerNorm, getattr(nn, "RMSNorm", None)) if c is not None)


def _prefix(name: str) -> str:
    return f"{name}." if name else ""


def find_pairs(model: nn.Module, tp: int) -> dict[str, tuple[list[str], str]]:
    """``{module name: ([column-wise child names], row-wise child name)}`` per matched block.

    The row-wise layer is the last direct ``Linear`` child (not the first) whose input width
    some other child produces; every other direct ``Linear`` child must read the block's
    width (the row-wise output) and split evenly over ``tp`` ranks. A fused ``qkv`` projection (3x width) does not
    match, so it is left alone rather than split wrongly.
    """
    pairs: dict[str, tuple[list[str], str]] = {}
    for name, module in model.named_modules():
        linears = [(n, c) for n, c in module.named_children() if isinstance(c, nn.Linear)]
        if len(linears) < 2:
            continue
        for row_name, row in reversed(linears[1:]):  # the row-wise layer comes after a column one
            cols = [(n, c) for n, c in linears if n != row_name]
            if row.in_features % tp:
                continue
            if all(c.in_features == row.out_features and c.out_features % tp == 0
                   for _, c in cols) and any(c.out_features == row.in_features for _, c in cols):
                pairs[name] = ([n for n, _ in cols], row_name)
                break
    return pairs


def _head(model: nn.Module, taken: set[str]) -> str | None:
    """The output head for loss parallel: the model's last ``Linear`` outside every pair."""
    last = None
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name not in taken:
            last = name
    return last


def auto_plan(model: nn.Module, tp: int, *, sequence_parallel: bool = False,
              loss_parallel: bool = False) -> dict[str, ParallelStyle]:
    """A plan for ``parallelize_module`` from the model's structure (see the module doc).

    ``sequence_parallel``: inside every module that holds norms and matched blocks (a
    transformer block), activations are split along dim 1 (the sequence) between the
    row-wise and column-wise layers, so norms and dropout work on 1/tp of the tokens; the
    block's input is split on entry and gathered on exit. ``loss_parallel``: the output head
    is column-wise with sharded logits, for cross-entropy under ``loss_parallel()``.
    """
    pairs = find_pairs(model, tp)
    sp_blocks: list[str] = []
    if sequence_parallel:
        for name, module in model.named_modules():
            norms = [n for n, c in module.named_children() if isinstance(c, _NORMS)]
            # a transformer block: norms and matched blocks (attention, MLP) side by side
            inside = [p for p in pairs if p != name and p.rpartition(".")[0] == name]
            if norms and inside:
                sp_blocks.append(name)
    plan: dict[str, ParallelStyle] = {}
    for name, (cols, row) in pairs.items():
        in_sp = name.rpartition(".")[0] in sp_blocks and name not in sp_blocks
        if in_sp:
            # the attention/MLP module gathers the sequence on entry, scatters it on exit
            plan[name] = PrepareModuleInput(input_layouts=(Shard(1),),
                                            desired_input_layouts=(Replicate(),))
        for col in cols:
            plan[_prefix(name) + col] = ColwiseParallel()
        plan[_prefix(name) + row] = RowwiseParallel(output_layouts=Shard(1)) if in_sp \
            else RowwiseParallel()
    for block in sp_blocks:
        module = model.get_submodule(block)
        for n, child in module.named_children():
            if isinstance(child, _NORMS):
                plan[_prefix(block) + n] = SequenceParallel()
        plan[block] = PrepareModuleInputOutput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
            use_local_input=True, output_layouts=(Shard(1),),
            desired_output_layouts=(Replicate(),), use_local_output=True)
    if loss_parallel:
        head = _head(model, set(plan))
        if head is None:
            raise UsageError("--tp-loss-parallel needs a Linear output head in the model "
                             "(none is left outside the tensor-parallel blocks)")
        plan[head] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    return plan


def parallelize(model: nn.Module, tp_mesh: DeviceMesh, task: Any, options: TpOptions,
                log: logging.Logger, verbose: bool = True) -> nn.Module:
    """Apply the task's ``parallelize_plan(mesh)`` or the automatic plan over ``tp_mesh``."""
    custom = getattr(task, "parallelize_plan", None)
    plan = custom(tp_mesh) if custom is not None else None
    source = "the task's parallelize_plan"
    if plan is None:
        plan = auto_plan(model, tp_mesh.size(), sequence_parallel=options.tp_sequence_parallel,
                         loss_parallel=options.tp_loss_parallel)
        source = "the automatic plan"
    if not plan:
        raise UsageError(
            f"tensor parallel found nothing to split in {type(model).__name__}: no pair of "
            f"Linear layers (MLP/attention) divisible by {tp_mesh.size()} ranks; define "
            "task.parallelize_plan(mesh) returning {module name: ColwiseParallel(), ...}"
        )
    if verbose:
        lines = [f"  {k}: {type(v).__name__}" for k, v in plan.items()] \
            if isinstance(plan, dict) else [f"  <root>: {type(plan).__name__}"]
        log.info("tp: %d-way, %s:\n%s", tp_mesh.size(), source, "\n".join(lines))
    return parallelize_module(model, tp_mesh, plan)
