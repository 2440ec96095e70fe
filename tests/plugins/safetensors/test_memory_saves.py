"""The memory tier's saves across ranks: a save across one node's ranks (the tier over several
nodes), each node's folder a whole checkpoint of the state its ranks hold, loaded back by them
or by any other layout; in-place saves after the first, failing together with no call of
their own."""

from __future__ import annotations

import json
import os

import pytest
import torch
from st_layouts import MLP
from st_memory import rank_node_saves, rank_parts_and_replicas, rank_quiet_failure

from distrun.testing import run_on_ranks


def test_each_node_saves_a_whole_checkpoint_of_its_ranks_hsdp_state(tmp_path):
    """HSDP on 4 ranks (sharded within 2 nodes of 2, replicated across them): each node's
    ranks save into their own folder, and each rank resumes from its own node's folder
    bit-equal, with its own contributed state; either node's folder alone loads into one
    process whole. FSDP over all 4 ranks is seen not to be whole on a node."""
    results = run_on_ranks(rank_node_saves, 4, str(tmp_path), init_process_group=True,
                           timeout=240)
    for rank, got in enumerate(results):
        assert got["bad"] == [], (rank, got["bad"])
        assert got["who"] == rank, got
        assert got["path"] == str(tmp_path / f"node{rank // 2}" / "step-2"), got
        assert got["whole"] and not got["split"], got
    from distrun_safetensors.load import load

    for node in ("node0", "node1"):
        model = MLP()
        assert load(str(tmp_path / node / "step-2"), model) is not None
        for name, t in model.state_dict().items():
            assert torch.equal(t, results[0]["full"][f"model/{name}"]), (node, name)
    manifest = json.loads((tmp_path / "node1" / "step-2" / "manifest.json").read_text())
    assert manifest["states"]["ranks"] == [2, 3] and manifest["world_size"] == 2, manifest
    assert not os.path.exists(tmp_path / "none")


def test_an_in_place_save_that_fails_on_one_rank_fails_on_every_rank_at_wait(tmp_path):
    """After the first, an in-place save starts with no call between the ranks; a rank that
    cannot save says so through the commit: every rank raises its reason at ``wait`` (no
    rank hangs), nothing of that save is left, and the next save commits."""
    results = run_on_ranks(rank_quiet_failure, 2, str(tmp_path / "mem"),
                           init_process_group=True, timeout=120)
    for got in results:
        first, failed, third = got["outcomes"]
        assert first == third == "saved", got
        assert failed.startswith("wait: checkpoint step 2 was not saved: rank 1: ") and \
            "bad" in failed, got
    names = results[0]["names"]
    assert [n for n in names if n.startswith("step-")] == ["step-3"], names
    assert not [n for n in names if n.startswith(".tmp")], names


def test_a_state_sharded_across_nodes_is_saved_in_parts_each_copied_to_the_other_node(
        tmp_path, caplog):
    """FSDP over 4 ranks of two nodes: each node's folder holds its part of the state (refused
    as a checkpoint by any reader but the tier's resume) and, in ``replica/``, the other
    node's part of the same step, copied over gloo in many chunks (the older step's copy
    removed); each node's view of a step is the whole checkpoint: each rank resumes from it
    bit-equal with its own state, and one unsharded model loads it whole."""
    results = run_on_ranks(rank_parts_and_replicas, 4, str(tmp_path), init_process_group=True,
                           timeout=240)
    for rank, got in enumerate(results):
        assert got["bad"] == [] and got["whole"] == [], (rank, got)
        assert got["who"] == rank, got
        assert got["path"] == str(tmp_path / f"node{rank // 2}" / f"views-{rank}" / "step-3")
        assert "one node's part of a memory checkpoint" in got["refused"], got
        assert got["replicas"] == ["step-3"], got
    for k in (0, 1):
        own = json.loads((tmp_path / f"node{k}" / "step-3" / "manifest.json").read_text())
        copy = tmp_path / f"node{1 - k}" / "replica" / "step-3"
        assert json.loads((copy / "manifest.json").read_text()) == own
        for name in own["files"]:
            assert (copy / name).read_bytes() == (tmp_path / f"node{k}" / "step-3" /
                                                  name).read_bytes(), name
        view = json.loads((tmp_path / f"node{k}" / f"views-{2 * k}" / "step-3" /
                           "manifest.json").read_text())
        assert "part" not in view and view["states"]["world_size"] == 4, view
    # node 1 lost before its copy of step 3 reached node 0: node 0 re-formed alone has only its
    # own part of that step; its view is skipped in one line for the next newest checkpoint
    # (here the disk's), never loaded as a whole
    import shutil

    from st_layouts import full_state

    from distrun_safetensors.load import NodeFolder, load
    from distrun_safetensors.replica import build_views, replica_dir
    from distrun_safetensors.save import Checkpointer

    shutil.rmtree(os.path.join(replica_dir(str(tmp_path / "node0")), "step-3"))
    views = build_views(str(tmp_path / "node0"), "views-alone")
    assert views is not None and os.path.isdir(os.path.join(views, "step-3"))
    torch.manual_seed(3)
    on_disk = MLP()
    on_disk_opt = torch.optim.AdamW(on_disk.parameters(), lr=0.05)
    Checkpointer(str(tmp_path / "disk")).save(2, on_disk, on_disk_opt, {"progress": {"step": 2}})
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    with caplog.at_level("WARNING"):
        result = load("latest", model, opt, ckpt_dir=str(tmp_path / "disk"),
                      tier=NodeFolder(views, views, None, 0, 1))
    assert result is not None and result.path == str(tmp_path / "disk" / "step-2"), result
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skipped) == 1 and "views-alone/step-3" in skipped[0] and \
        "not fully stored" in skipped[0], skipped
    assert [k for k, v in full_state(model, opt).items()
            if not torch.equal(v, full_state(on_disk, on_disk_opt)[k])] == []


def test_the_copy_streams_files_of_any_size_across_chunks(tmp_path, monkeypatch):
    """What the copy sends is the part's files one after the other, in chunks; the receiver
    writes them back as they were: empty files first, between and last, a file across
    several chunks, a chunk across several files; a stream that ends early is refused."""
    import distrun_safetensors.replica as replica
    from distrun_safetensors.files import CheckpointError

    monkeypatch.setattr(replica, "_CHUNK", 7)
    files = [("a", b""), ("b", b"hello world, chunked"), ("c", b""), ("d", b"xyz"), ("e", b"")]
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    for name, data in files:
        (src / name).write_bytes(data)
    listing = [(name, len(data)) for name, data in files]
    sink = replica._Sink(str(dst), listing)
    for chunk in replica._chunks(str(src), listing):
        sink.write(memoryview(bytes(chunk)))
    sink.close()
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == dict(files)
    short = tmp_path / "short"
    short.mkdir()
    cut = replica._Sink(str(short), listing)
    cut.write(memoryview(b"hello"))
    with pytest.raises(CheckpointError, match="ended early"):
        cut.close()
