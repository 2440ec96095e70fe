"""SLURM's compressed host lists and task counts, expanded without ``scontrol``.

``node[01-04,07]`` -> node01 node02 node03 node04 node07; ``a[1-2]-ib,b3`` -> a1-ib a2-ib b3;
``rack[1-2]-n[1-2]`` -> rack1-n1 rack1-n2 rack2-n1 rack2-n2 (brackets multiply, as in SLURM).
``2(x3),1`` (SLURM_TASKS_PER_NODE) -> [2, 2, 2, 1].
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from distrun.plugin import UsageError

__all__ = ["expand_nodelist", "first_host", "expand_tasks_per_node"]

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise UsageError(f"bad SLURM node list {text!r}: unbalanced ']'")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise UsageError(f"bad SLURM node list {text!r}: unbalanced '['")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _bracket_values(body: str, whole: str) -> list[str]:
    out = []
    for item in body.split(","):
        m = _RANGE.match(item.strip())
        if not m:
            raise UsageError(f"bad SLURM node list {whole!r}: cannot read range {item!r}")
        lo, hi = m.group(1), m.group(2)
        if hi is None:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise UsageError(f"bad SLURM node list {whole!r}: range {item!r} goes backwards")
        width = len(lo)  # zero padding follows the lower bound, as SLURM prints it
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out


def _expand_one(pattern: str, whole: str) -> Iterator[str]:
    open_at = pattern.find("[")
    if open_at < 0:
        yield pattern
        return
    close_at = pattern.find("]", open_at)
    head, body, tail = pattern[:open_at], pattern[open_at + 1:close_at], pattern[close_at + 1:]
    for value in _bracket_values(body, whole):
        for rest in _expand_one(tail, whole):
            yield head + value + rest


def expand_nodelist(nodelist: str) -> list[str]:
    """Every host of a SLURM node list, in SLURM's order."""
    hosts: list[str] = []
    for part in _split_top(nodelist):
        hosts.extend(_expand_one(part, nodelist))
    return hosts


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list (where rank 0 runs, so the master address)."""
    parts = _split_top(nodelist)
    if not parts:
        raise UsageError(f"empty SLURM node list {nodelist!r}")
    return next(_expand_one(parts[0], nodelist))


def expand_tasks_per_node(value: str) -> list[int]:
    """SLURM_TASKS_PER_NODE (``2(x3),1``) as one count per node."""
    out: list[int] = []
    for item in value.split(","):
        m = re.match(r"^\s*(\d+)(?:\(x(\d+)\))?\s*$", item)
        if not m:
            raise UsageError(f"bad SLURM tasks-per-node value {value!r}")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out
