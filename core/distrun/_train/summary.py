"""The model summary table printed on rank 0 at the start of a fit (as Lightning prints it)."""

from __future__ import annotations

import torch

__all__ = ["model_summary"]


def _count(params) -> int:
    # DTensor.numel() is the global size, which is what a summary should show.
    return sum(p.numel() for p in params)


def _human(n: float) -> str:
    for unit in ("", "K", "M", "B", "T"):
        if abs(n) < 1000:
            return f"{n:.1f} {unit}".rstrip() if unit else str(int(n))
        n /= 1000.0
    return f"{n:.1f} P"


def model_summary(model: torch.nn.Module) -> str:
    """A table of the top-level children (Name | Type | Params) with totals and size in MB."""
    rows = [(name, type(child).__name__, _count(child.parameters()))
            for name, child in model.named_children()]
    total = _count(model.parameters())
    trainable = _count(p for p in model.parameters() if p.requires_grad)
    size_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
    w_name = max([4, *(len(r[0]) for r in rows)])
    w_type = max([4, *(len(r[1]) for r in rows)])
    head = f"  | {'Name':<{w_name}} | {'Type':<{w_type}} | Params"
    lines = [head, "-" * (len(head) + 2)]
    for i, (name, typ, n) in enumerate(rows):
        lines.append(f"{i:<2}| {name:<{w_name}} | {typ:<{w_type}} | {_human(n)}")
    lines.append("-" * (len(head) + 2))
    lines += [
        f"{_human(trainable):<10} Trainable params",
        f"{_human(total - trainable):<10} Non-trainable params",
        f"{_human(total):<10} Total params",
        f"{size_mb:<10.3f} Total estimated model params size (MB)",
    ]
    return "\n".join(lines)
