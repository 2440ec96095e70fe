"""Rank functions of the memory tier's save tests (module level, for ``run_on_ranks``): a save
across one node's ranks, as the tier makes it over several nodes, and in-place saves after the
first, which start with no call between the ranks."""

from __future__ import annotations

import os
from typing import Any

import torch
from st_layouts import MLP, build, compare, full_state, train_step

#: four ranks as two nodes of two
NODES = [(0, 1), (2, 3)]


def _hsdp(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """FSDP2 sharded within each node and replicated across them (HSDP)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = MLP()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    fully_shard(model.fc1, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def _fsdp_everywhere() -> torch.nn.Module:
    """FSDP2 over all four ranks: each node holds half of every tensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = MLP()
    fully_shard(model, mesh=init_device_mesh("cpu", (4,)))
    return model


def rank_node_saves(rank: int, world: int, root: str) -> dict[str, Any]:
    """Each node saves its own ranks' HSDP state into ``root/node<k>``; each rank loads its own
    node's folder back into a fresh model; returns what differs, the folder and the state."""
    import torch.distributed as dist

    from distrun_safetensors.load import NodeFolder, load
    from distrun_safetensors.save import Checkpointer, Scope
    from distrun_safetensors.tier_nodes import node_holds_all

    node = next(n for n in NODES if rank in n)
    mine, _ = dist.new_subgroups_by_enumeration(NODES, backend="gloo")
    background, _ = dist.new_subgroups_by_enumeration(NODES, backend="gloo")
    scope = Scope(members=node, group=mine, background=background,
                  across=dist.new_group(backend="gloo"))
    model, opt = _hsdp(seed=1)
    for i in range(2):
        train_step(model, opt, 10 + i)
    folder = os.path.join(root, f"node{NODES.index(node)}")
    saver = Checkpointer(folder, keep_last=1, split_bytes=64, async_save=True, in_place=True,
                         scope=scope)
    saver.save(2, model, opt, {"progress": {"step": 2}, "who": rank}, reason="test")
    saver.wait()
    want = full_state(model, opt)
    fresh, fresh_opt = _hsdp(seed=99)
    tier = NodeFolder(folder, os.path.join(root, "node0"), None, node.index(rank), len(node))
    result = load("latest", fresh, fresh_opt, ckpt_dir=os.path.join(root, "none"), tier=tier)
    assert result is not None
    return {"bad": compare(full_state(fresh, fresh_opt), want), "path": result.path,
            "who": result.state.get("who"), "whole": node_holds_all(model, node),
            "split": node_holds_all(_fsdp_everywhere(), node),
            "full": {k: v for k, v in want.items() if k.startswith("model/")}}


def rank_quiet_failure(rank: int, world: int, root: str) -> dict[str, Any]:
    """In-place saves of steps 1, 2, 3 on 2 ranks, rank 1's state of step 2 not data: the save
    of step 2 fails on both ranks at ``wait`` (with rank 1's reason), no hang, and step 3
    saves; returns each outcome and the folder's names."""
    from distrun_safetensors.files import CheckpointError
    from distrun_safetensors.save import Checkpointer

    model, opt = build("plain")
    saver = Checkpointer(root, keep_last=1, split_bytes=64, async_save=True, in_place=True)
    outcomes = []
    for step in (1, 2, 3):
        train_step(model, opt, step)
        state: dict[str, Any] = {"progress": {"step": step}}
        if step == 2 and rank == 1:
            state["bad"] = object()
        where = "save"
        try:
            saver.save(step, model, opt, state)
            where = "wait"  # the save started without a call between the ranks
            saver.wait()
            outcomes.append("saved")
        except CheckpointError as exc:
            outcomes.append(f"{where}: {exc}")
    return {"outcomes": outcomes, "names": sorted(os.listdir(root))}


def rank_parts_and_replicas(rank: int, world: int, root: str) -> dict[str, Any]:
    """FSDP over all 4 ranks (two nodes of two): each node saves its part of steps 2 and 3 into
    ``root/node<k>``, its first rank copying it into the other node's ``replica/`` in chunks
    of 1000 bytes; each rank then resumes a fresh model from its node's views, and loads the
    view of step 3 whole into one unsharded model. Returns what differs and the names seen."""
    import torch.distributed as dist

    import distrun_safetensors.replica as replica
    from distrun_safetensors.files import CheckpointError
    from distrun_safetensors.load import NodeFolder, load
    from distrun_safetensors.save import Checkpointer, Scope
    from distrun_safetensors.validation import validate

    replica._CHUNK = 1000  # many chunks, one file across several of them
    node = next(n for n in NODES if rank in n)
    mine, _ = dist.new_subgroups_by_enumeration(NODES, backend="gloo")
    background, _ = dist.new_subgroups_by_enumeration(NODES, backend="gloo")
    across = dist.new_group(backend="gloo")
    firsts = dist.new_group([0, 2], backend="gloo")
    ring = replica.Ring(firsts, 2 - node[0], 2 - node[0], 0.0)
    scope = Scope(members=node, group=mine, background=background, across=across, part_of=4,
                  ring=ring)
    torch.manual_seed(1)
    model = _fsdp_everywhere()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    folder = os.path.join(root, f"node{NODES.index(node)}")
    saver = Checkpointer(folder, keep_last=1, split_bytes=64, async_save=True, in_place=True,
                         scope=scope)
    for step in (2, 3):
        train_step(model, opt, 10 + step)
        saver.save(step, model, opt, {"progress": {"step": step}, "who": rank}, reason="test")
        saver.wait()
    dist.barrier()
    want = full_state(model, opt)
    refused = None
    try:
        validate(os.path.join(folder, "step-3"))
    except CheckpointError as exc:
        refused = str(exc)
    views = replica.build_views(folder, f"views-{rank}")
    assert views is not None
    named = os.path.join(root, "node0", "views-0")
    torch.manual_seed(99)
    fresh = _fsdp_everywhere()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.05)
    result = load("latest", fresh, fresh_opt, ckpt_dir=os.path.join(root, "none"),
                  tier=NodeFolder(views, named, None, node.index(rank), len(node)))
    assert result is not None
    whole = MLP()
    load(os.path.join(views, "step-3"), whole)
    return {"bad": compare(full_state(fresh, fresh_opt), want), "path": result.path,
            "who": result.state.get("who"), "refused": refused,
            "whole": compare({f"model/{k}": v for k, v in whole.state_dict().items()},
                             {k: v for k, v in want.items() if k.startswith("model/")}),
            "names": sorted(os.listdir(folder)),
            "replicas": sorted(os.listdir(replica.replica_dir(folder)))}
