"""The memory tier over several nodes: which ranks are a node, whether a node's ranks hold
their state whole, a node's save scope (with the ring of a state sharded across nodes), and
the folder a resume reads (every rank calls these together)."""

from __future__ import annotations

import os
import socket
from typing import Any

__all__ = ["local_world", "node_holds_all", "node_scope", "node_tier", "nodes_of",
           "views_name"]


def local_world(run: Any) -> int:
    """The ranks on this node (torchrun's ``LOCAL_WORLD_SIZE``)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", run.world_size))


def nodes_of(run: Any, mine: str | None, extra: Any = None,
             ) -> tuple[list[tuple[int, ...]], list[Any]] | None:
    """The global ranks of each node, known by the tier folder they share (``mine``: this
    rank's), and every rank's ``(host, folder, extra)`` (every rank calls this together; one
    node: none); None when a rank has no folder."""
    if run.world_size == 1 or run.world_size == local_world(run):
        return None
    import torch.distributed as dist

    seen: list[Any] = [None] * run.world_size
    dist.all_gather_object(seen, (socket.gethostname(), mine, extra) if mine else None)
    if any(s is None for s in seen):
        return None
    nodes: dict[Any, list[int]] = {}
    for rank, (host, folder, _) in enumerate(seen):
        nodes.setdefault((host, folder), []).append(rank)
    return [tuple(ranks) for ranks in nodes.values()], seen


def views_name(rank: int) -> str:
    return f"views-{rank}"


def node_tier(run: Any, folder: str | None) -> Any:
    """The memory tier's folder for a resume (a :class:`~distrun_safetensors.load.NodeFolder`)
    where the launcher gave one (``folder``, this node's): across nodes, each node's own, with
    the steps every node committed (every rank calls this together); None without. A tier of
    parts (a state sharded across nodes) is read through this rank's views of them
    (replica.py)."""
    from distrun_safetensors.load import NodeFolder, _step_of
    from distrun_safetensors.manifest import candidates
    from distrun_safetensors.replica import build_views

    read = (build_views(folder, views_name(run.rank)) or folder) if folder else None
    if run.world_size == local_world(run):
        if folder is None or read is None:
            return None
        named = os.path.join(folder, views_name(0)) if read != folder else folder
        return NodeFolder(read, named, None, run.rank, run.world_size)
    steps = frozenset(_step_of(f) for f in candidates(folder)[0]) if folder else None
    known = nodes_of(run, folder, (steps, read))
    if known is None or folder is None or read is None:
        return None
    nodes, seen = known
    common = frozenset.intersection(*(s[0] for _, _, s in seen))
    node = next(n for n in nodes if run.rank in n)
    return NodeFolder(read, seen[0][2][1], common, node.index(run.rank), len(node))


def node_holds_all(model: Any, members: tuple[int, ...]) -> bool:
    """Whether ``members`` (one node's ranks) hold every part of the model's tensors between
    them: a DTensor sharded over ranks of other nodes is not (FSDP across nodes)."""
    from distrun_safetensors.pieces import is_dtensor

    for t in model.state_dict().values():
        if not is_dtensor(t):
            continue
        from torch.distributed.tensor import Replicate  # (a DTensor: it imports)

        ranks = t.device_mesh.mesh
        dims = [i for i, p in enumerate(t.placements) if not isinstance(p, Replicate)]
        held = set()
        for rank in members:
            at = (ranks == rank).nonzero()
            if len(at):
                held.add(tuple(int(at[0][i]) for i in dims))
        need = 1
        for i in dims:
            need *= ranks.shape[i]
        if len(held) < need:
            return False
    return True


def node_scope(run: Any, nodes: list[tuple[int, ...]], replica_mb_s: float | None = None) -> Any:
    """This node's ranks as a save scope: two process groups of them (the saves' calls and
    their background writes) and one of every rank (every rank calls this together). With
    ``replica_mb_s`` (a state sharded across nodes) the node saves its part, and its first rank
    copies it to the next node's (replica.py): a group of the nodes' first ranks."""
    import torch.distributed as dist

    from distrun_safetensors.replica import Ring
    from distrun_safetensors.save import Scope

    mine, _ = dist.new_subgroups_by_enumeration(nodes, backend="gloo")
    background, _ = dist.new_subgroups_by_enumeration(nodes, backend="gloo")
    across = dist.new_group(backend="gloo")
    node = next(n for n in nodes if run.rank in n)
    if replica_mb_s is None:
        return Scope(members=node, group=mine, background=background, across=across)
    firsts = sorted(n[0] for n in nodes)
    group = dist.new_group(firsts, backend="gloo")
    at = firsts.index(node[0])
    ring = Ring(group, firsts[(at + 1) % len(firsts)], firsts[at - 1], replica_mb_s)
    return Scope(members=node, group=mine, background=background, across=across,
                 part_of=run.world_size, ring=ring)
