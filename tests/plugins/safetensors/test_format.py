"""One process: the folder format, HF interop, state codec, retention and `latest` fallback."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from st_layouts import build, compare, full_state, train_step

from distrun_safetensors.files import CheckpointError
from distrun_safetensors.load import load
from distrun_safetensors.manifest import VERSION
from distrun_safetensors.save import Checkpointer
from distrun_safetensors.statecodec import decode, encode
from distrun_safetensors.validation import validate


def _saved(tmp_path, steps=(1,), keep_last=0, **kw):
    model, opt = build("plain")
    saver = Checkpointer(str(tmp_path / "ckpt"), keep_last=keep_last, **kw)
    paths = []
    for step in steps:
        train_step(model, opt, step)
        paths.append(saver.save(step, model, opt, {"progress": {"step": step}}))
    saver.wait()  # old checkpoints are removed in the background
    return model, opt, paths


def test_folder_has_hf_index_manifest_and_no_pickle(tmp_path):
    model, opt, (path,) = _saved(tmp_path)
    names = sorted(os.listdir(path))
    assert all(n.endswith((".json", ".safetensors")) for n in names), names
    manifest = json.loads((tmp_path / "ckpt/step-1/manifest.json").read_text())
    assert manifest["version"] == VERSION and manifest["step"] == 1
    assert set(manifest["files"]) == set(names) - {"manifest.json"}
    index = json.loads((tmp_path / "ckpt/step-1/model.safetensors.index.json").read_text())
    sd = model.state_dict()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in sd.values())
    assert set(index["distrun"]["tensors"]) == set(sd)
    from safetensors import safe_open

    for key, fname in index["weight_map"].items():
        with safe_open(os.path.join(path, fname), "pt") as f:
            assert key in f.keys()  # noqa: SIM118 (safe_open has no __contains__)
    assert (tmp_path / "ckpt/latest").read_text().strip() == "step-1"


def test_consolidate_interop_with_safetensors_load_file(tmp_path):
    from safetensors.torch import load_file

    from distrun_safetensors.consolidate import consolidate

    model, _, (path,) = _saved(tmp_path, split_bytes=16)  # force many pieces per tensor
    out = tmp_path / "hf"
    index = consolidate(path, str(out), max_shard_bytes=200)
    on_disk = json.loads((out / "model.safetensors.index.json").read_text())
    assert on_disk["weight_map"] == index["weight_map"]
    shards = sorted(set(on_disk["weight_map"].values()))
    assert len(shards) > 1
    loaded = {}
    for shard in shards:
        loaded.update(load_file(str(out / shard)))
    sd = model.state_dict()
    assert set(loaded) == set(sd) == set(on_disk["weight_map"])
    assert on_disk["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                    for t in loaded.values())
    for k, v in sd.items():
        assert torch.equal(loaded[k], v), k


def test_state_codec_round_trip_and_refusal():
    import random

    import numpy as np

    state = {"rng": {"torch": torch.get_rng_state(), "python": (3, (1, 2), None)},
             "ints": {1: "a", 2: [1.5, float("inf")]}, "nested": [{"t": torch.arange(3)}],
             "random": random.getstate(), "np": [np.uint32(7), 1, True]}
    tensors: dict = {}
    encoded = json.loads(json.dumps(encode(state, "s", tensors)))
    back = decode(encoded, tensors.__getitem__)
    assert torch.equal(back["rng"]["torch"], state["rng"]["torch"])
    assert back["rng"]["python"] == (3, (1, 2), None)
    assert back["ints"] == {1: "a", 2: [1.5, float("inf")]}
    assert torch.equal(back["nested"][0]["t"], torch.arange(3))
    assert back["random"] == random.getstate()  # 625 ints as they are, in their tuples
    assert back["np"] == [7, 1, True] and type(back["np"][0]) is int
    with pytest.raises(CheckpointError, match=r"'s.bad' is a object"):
        encode({"bad": object()}, "s", {})


def test_round_trip_restores_model_optimizer_and_state(tmp_path):
    model, opt, (path,) = _saved(tmp_path)
    want = full_state(model, opt)
    fresh, fresh_opt = build("plain", seed=5)
    result = load(path, fresh, fresh_opt)
    assert compare(full_state(fresh, fresh_opt), want) == []
    assert result.state == {"progress": {"step": 1}} and result.step == 1
    # the optimizer goes on exactly as the original would
    train_step(model, opt, 9)
    train_step(fresh, fresh_opt, 9)
    assert compare(full_state(fresh, fresh_opt), full_state(model, opt)) == []


def test_keep_last_prunes_only_after_commit_and_cleans_leftovers(tmp_path):
    (tmp_path / "ckpt").mkdir()
    stale = tmp_path / "ckpt" / ".tmp-step-0-deadbeef"
    stale.mkdir()
    _, _, paths = _saved(tmp_path, steps=(1, 2, 3, 4), keep_last=2)
    left = sorted(os.listdir(tmp_path / "ckpt"))
    assert left == [".generation", "latest", "step-3", "step-4"]
    assert (tmp_path / "ckpt/latest").read_text().strip() == "step-4"


def test_reads_format_version_1_checked_with_zlib_crc32(tmp_path):
    """A checkpoint written by distrun-safetensors 0.1 (format 1, zlib CRC-32: kept in
    data/format-v1) loads bit-equal with its checksums verified; a damaged copy is refused.

    The reference is the stored tensors themselves, read by safetensors' own reader: training
    steps recomputed here would differ in the last bits on another CPU than the one that
    wrote the files (float results of a step are not portable across CPUs)."""
    import shutil

    from safetensors.torch import load_file

    v1 = Path(__file__).parent / "data" / "format-v1"
    manifest = json.loads((v1 / "manifest.json").read_text())
    assert manifest["version"] == 1 and manifest["checksum"] == "crc32"
    stored = {f"model/{k}": v for k, v in
              load_file(str(v1 / "model-00001-of-00001.safetensors")).items()}
    stored.update({f"optim/{k}": v for k, v in
                   load_file(str(v1 / "optim-00001-of-00001.safetensors")).items()})
    assert len(stored) == 5 + 12  # every tensor whole (one rank wrote them)
    fresh, fresh_opt = build("plain", seed=5)
    assert compare(full_state(fresh, fresh_opt), stored) != []  # the load has work to do
    result = load(str(v1), fresh, fresh_opt)
    assert result.step == 2 and result.state == {"progress": {"step": 2}}
    assert compare(full_state(fresh, fresh_opt), stored) == []
    copy = tmp_path / "v1"
    shutil.copytree(v1, copy)
    data = bytearray((copy / "model-00001-of-00001.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (copy / "model-00001-of-00001.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load(str(copy), fresh, fresh_opt)


def test_new_checkpoints_are_checked_with_crc32c(tmp_path):
    import crc32c

    _, _, (path,) = _saved(tmp_path)
    manifest = json.loads((Path(path) / "manifest.json").read_text())
    assert manifest["version"] == VERSION == 2 and manifest["checksum"] == "crc32c"
    for name, info in manifest["files"].items():
        want = crc32c.crc32c((Path(path) / name).read_bytes())
        assert info["crc32c"] == f"{want:08x}", name


@pytest.mark.parametrize("size", [0, 1, 7, (32 << 20) - 1, (96 << 20) + 5])
def test_a_checksum_in_parts_is_the_checksum_of_one_pass(size):
    """The in-place saves checksum their files in parts on several threads and join them:
    the same 8 hex digits as crc32c over the whole, where the parts split anywhere."""
    import crc32c

    from distrun_safetensors.checksums import checksum_in_parts, crc32c_join

    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator()
                         .manual_seed(size)).numpy()
    want = f"{crc32c.crc32c(data.tobytes()):08x}"
    for workers in (1, 2, 3, 4):
        assert checksum_in_parts(data, workers=workers) == want, workers
    raw = data.tobytes()
    for cut in {0, 1, size // 3, size}:
        first, second = raw[:cut], raw[cut:]
        assert crc32c_join(crc32c.crc32c(first), crc32c.crc32c(second), len(second)) == \
            int(want, 16), cut


def test_async_saves_reuse_their_buffers_and_hold_each_snapshot(tmp_path):
    model, opt = build("plain")
    saver = Checkpointer(str(tmp_path / "ckpt"), async_save=True, split_bytes=16)
    buffers, states = [], {}
    for step in (1, 2, 3):
        train_step(model, opt, step)
        states[step] = full_state(model, opt)
        saver.save(step, model, opt, {"progress": {"step": step}})
        assert saver.stats["step"] == step and saver.stats["write_s"] is None
        buffers.append({k: b.data_ptr() for k, b in saver._staging.items()})
        train_step(model, opt, step + 100)  # training goes on while the write is in flight
    saver.wait()
    assert saver.stats["write_s"] > 0
    assert buffers[0] == buffers[1] == buffers[2] and buffers[0]  # allocated once, reused
    for step, want in states.items():
        fresh, fresh_opt = build("plain", seed=7)
        load(str(tmp_path / "ckpt" / f"step-{step}"), fresh, fresh_opt)
        assert compare(full_state(fresh, fresh_opt), want) == [], step


def test_in_place_saves_write_the_same_files_into_two_copies_at_most(tmp_path):
    """The memory tier's saves (in_place.py) copy the snapshot straight into the files: the
    bytes of an ordinary save, each step's snapshot intact while training goes on, and no
    more than two copies of the data at any time (the newest committed one and the one being
    written, whose files are recycled)."""
    model, opt = build("plain")
    in_place = Checkpointer(str(tmp_path / "mem"), keep_last=1, async_save=True,
                            split_bytes=16, in_place=True)
    plain = Checkpointer(str(tmp_path / "disk"), keep_last=1, async_save=True, split_bytes=16)
    inodes: set[int] = set()
    for step in range(1, 6):
        train_step(model, opt, step)
        want = full_state(model, opt)
        for saver in (in_place, plain):
            saver.save(step, model, opt, {"progress": {"step": step}})
        train_step(model, opt, step + 100)  # training goes on while the writes are in flight
        in_place.wait()
        plain.wait()
        mem, disk = tmp_path / "mem" / f"step-{step}", tmp_path / "disk" / f"step-{step}"
        data = sorted(n.name for n in disk.glob("*.safetensors"))
        assert data == sorted(n.name for n in mem.glob("*.safetensors"))
        for name in data:
            assert (mem / name).read_bytes() == (disk / name).read_bytes(), (step, name)
        inodes |= {os.stat(mem / name).st_ino for name in data if name.startswith(("model-",
                                                                                  "optim-"))}
        fresh, fresh_opt = build("plain", seed=7)
        assert load(str(mem), fresh, fresh_opt).step == step
        assert compare(full_state(fresh, fresh_opt), want) == [], step
    assert not in_place._staging  # no buffers
    assert len(inodes) == 2 * 2  # the model's and the optimizer's file, two of each


def test_a_disk_save_writes_from_the_in_place_snapshot_which_no_save_overwrites_meanwhile(
        tmp_path):
    """A disk save given the memory tier's snapshot of its step writes the same files as one
    that copies the live state, in the background; while a snapshot is held (pinned), later
    in-place saves take fresh files instead of writing over it, and its files are let go
    once it is released."""
    model, opt = build("plain")
    memory = Checkpointer(str(tmp_path / "mem"), keep_last=1, async_save=True, split_bytes=16,
                          in_place=True)
    disk = Checkpointer(str(tmp_path / "disk"), keep_last=0, split_bytes=16)
    plain = Checkpointer(str(tmp_path / "plain"), keep_last=0, split_bytes=16)
    for step in (1, 2):
        train_step(model, opt, step)
        memory.save(step, model, opt, {"progress": {"step": step}})
    held = memory.snapshot(2)
    assert held is not None and memory.snapshot(1) is None  # the last save's only
    want = full_state(model, opt)
    plain.save(2, model, opt, {"progress": {"step": 2}})
    for step in (3, 4, 5):  # training and the tier go on while the disk write would run
        train_step(model, opt, step)
        memory.save(step, model, opt, {"progress": {"step": step}})
    memory.wait()
    spares = tmp_path / "mem" / ".spare-0"
    assert any(n.name.startswith("2-") for n in spares.iterdir())  # kept by the pin
    disk.save(2, model, opt, {"progress": {"step": 2}}, snapshot=held)
    assert disk.stats["from_snapshot"] and disk.stats["write_s"] is None  # in the background
    disk.wait()
    for name in sorted(p.name for p in (tmp_path / "plain" / "step-2").glob("*.safetensors")):
        if name.startswith(("model-", "optim-")):
            assert (tmp_path / "disk" / "step-2" / name).read_bytes() == \
                (tmp_path / "plain" / "step-2" / name).read_bytes(), name
    fresh, fresh_opt = build("plain", seed=7)
    load(str(tmp_path / "disk" / "step-2"), fresh, fresh_opt)
    assert compare(full_state(fresh, fresh_opt), want) == []
    assert not any(n.name.startswith("2-") for n in spares.iterdir())  # released: let go
    assert len(list(spares.iterdir())) == 2 * 2  # two steps' model and optimizer files


def test_a_restarted_rank_writes_over_the_spares_its_killed_process_left(tmp_path):
    """A rank killed after its in-place saves of steps 1-3 leaves spares of steps 2 and 3; its
    restart resumed from step 3 writes step 4 into step 2's files (no fresh pages), keeps
    step 3's (the checkpoint a second kill would load) intact, and saves the same bytes as
    an ordinary save. A process that did not resume from the tier lets them all go."""
    model, opt = build("plain")
    killed = Checkpointer(str(tmp_path / "mem"), keep_last=1, async_save=True, split_bytes=16,
                          in_place=True)
    for step in (1, 2, 3):
        train_step(model, opt, step)
        killed.save(step, model, opt, {"progress": {"step": step}})
    killed.wait()
    step_3 = {n.name: n.read_bytes() for n in (tmp_path / "mem" / "step-3").glob("*-*-of-*")}
    spares = tmp_path / "mem" / ".spare-0"
    left = {n.name: n.stat().st_ino for n in spares.iterdir()}
    assert sorted({name.split("-")[0] for name in left}) == ["2", "3"]
    del killed  # (as a kill leaves it: nothing let go)
    restarted = Checkpointer(str(tmp_path / "mem"), keep_last=1, async_save=True,
                             split_bytes=16, in_place=True)
    restarted.last = (3, str(tmp_path / "mem" / "step-3"))  # what the resume read
    plain = Checkpointer(str(tmp_path / "disk"), keep_last=1, async_save=True, split_bytes=16)
    train_step(model, opt, 4)
    at_4 = full_state(model, opt)
    for saver in (restarted, plain):
        saver.save(4, model, opt, {"progress": {"step": 4}})
    train_step(model, opt, 104)  # (training goes on while the write is in flight)
    restarted.wait()
    plain.wait()
    mem, disk = tmp_path / "mem" / "step-4", tmp_path / "disk" / "step-4"
    data = sorted(n.name for n in mem.glob("*.safetensors") if n.name.startswith(("model-",
                                                                                  "optim-")))
    assert data and {(mem / name).stat().st_ino for name in data} == {
        ino for name, ino in left.items() if name.startswith("2-")}
    for name in data:
        assert (mem / name).read_bytes() == (disk / name).read_bytes(), name
    fresh, fresh_opt = build("plain", seed=7)
    assert load(str(mem), fresh, fresh_opt).step == 4
    assert compare(full_state(fresh, fresh_opt), at_4) == []
    for name, old in step_3.items():  # step 3's files, kept as they were (pruned as a
        assert (spares / f"3-{name}").read_bytes() == old, name  # folder, written over later)
    other = Checkpointer(str(tmp_path / "mem"), keep_last=1, async_save=True, split_bytes=16,
                         in_place=True)
    other.save(5, model, opt, {"progress": {"step": 5}})  # (no resume from the tier)
    other.wait()
    assert sorted({n.name.split("-")[0] for n in spares.iterdir()}) == ["5"]


def test_auto_with_nothing_returns_none(tmp_path):
    model, opt = build("plain")
    assert load("auto", model, opt, ckpt_dir=str(tmp_path / "none")) is None
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / ".tmp-step-3-0000").mkdir()  # a crash during the very first save
    assert load("auto", model, opt, ckpt_dir=str(tmp_path / "ckpt")) is None
    with pytest.raises(CheckpointError, match="no checkpoint found"):
        load("latest", model, opt, ckpt_dir=str(tmp_path / "ckpt"))


@pytest.mark.parametrize("damage", ["corrupt", "torn", "pointer"])
def test_latest_falls_back_to_newest_valid_with_a_warning(tmp_path, caplog, damage):
    model, opt, paths = _saved(tmp_path, steps=(1, 2))
    newest = tmp_path / "ckpt" / "step-2"
    if damage == "corrupt":
        data = newest / "model-00001-of-00001.safetensors"
        raw = bytearray(data.read_bytes())
        raw[-3] ^= 0xFF
        data.write_bytes(bytes(raw))
        reason = "model-00001-of-00001.safetensors: checksum mismatch"
    elif damage == "torn":
        (newest / "manifest.json").unlink()
        reason = "manifest.json is missing"
    else:
        (tmp_path / "ckpt" / "latest").write_text("step-9\n")
        reason = "names step-9, which does not exist"
    fresh, fresh_opt = build("plain", seed=3)
    with caplog.at_level(logging.WARNING, logger="distrun"):
        result = load("latest", fresh, fresh_opt, ckpt_dir=str(tmp_path / "ckpt"))
    want_step = 1 if damage != "pointer" else 2
    assert result.step == want_step
    assert reason in caplog.text


@pytest.mark.parametrize("where", ["manifest", "index"])
def test_latest_stops_at_a_newer_format_instead_of_falling_back(tmp_path, where):
    """A checkpoint from a newer distrun-safetensors is not damaged: `latest` and `auto` stop
    with one line naming the versions this build reads, instead of training from an older
    step (whose later saves could then prune the newer one)."""
    from st_layouts import reseal

    _saved(tmp_path, steps=(1, 2))
    newest = tmp_path / "ckpt" / "step-2"
    name = "manifest.json" if where == "manifest" else "model.safetensors.index.json"
    data = json.loads((newest / name).read_text())
    (data if where == "manifest" else data["distrun"])["version"] = VERSION + 1
    (newest / name).write_text(json.dumps(data))
    if where == "index":
        reseal(newest, name)
    fresh, fresh_opt = build("plain", seed=3)
    before = full_state(fresh, fresh_opt)
    for source in ("latest", "auto"):
        with pytest.raises(CheckpointError) as info:
            load(source, fresh, fresh_opt, ckpt_dir=str(tmp_path / "ckpt"))
        message = str(info.value)
        assert f"version {VERSION + 1} was written by a newer distrun-safetensors; this build " \
               f"reads versions 1 to {VERSION}" in message and "\n" not in message, message
        assert message.startswith(str(newest / name))
    assert compare(full_state(fresh, fresh_opt), before) == []


def test_verify_off_skips_checksums(tmp_path):
    _, _, (path,) = _saved(tmp_path)
    data = os.path.join(path, "optim-00001-of-00001.safetensors")
    raw = bytearray(Path(data).read_bytes())
    raw[-1] ^= 0x01
    Path(data).write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        validate(path)
    validate(path, verify=False)  # the fast mode trusts the bytes


def test_state_that_is_not_data_fails_the_save_cleanly(tmp_path):
    model, opt = build("plain")
    saver = Checkpointer(str(tmp_path / "ckpt"))
    with pytest.raises(CheckpointError, match=r"'state.bad' is a object, which is neither"):
        saver.save(1, model, opt, {"bad": object()})
    assert os.listdir(tmp_path / "ckpt") == []  # no folder, no leftovers, no `latest`


def test_mappings_are_registered_with_cuda_once_and_unregistered_when_let_go(monkeypatch,
                                                                             caplog):
    """The bookkeeping of the in-place saves' registered mappings (the copies from a GPU run
    in the GPU lane's ``tier`` check; here the driver's two calls are recorded): one register
    per mapping however often it is written, one unregister when it is let go; a refusal
    turns registering off in one line and the saves go on."""
    from distrun_safetensors.in_place import _Registered

    calls: list[tuple[str, int]] = []

    class Driver:
        refuse = False

        def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
            calls.append(("register", ptr))
            return 1 if self.refuse else 0

        def cudaHostUnregister(self, ptr: int) -> int:
            calls.append(("unregister", ptr))
            return 0

    driver = Driver()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: driver)
    a, b = torch.zeros(64, dtype=torch.uint8), torch.zeros(32, dtype=torch.uint8)
    reg = _Registered()
    for _ in range(3):
        reg.add(a)
        reg.add(b)
    reg.drop(a)
    reg.drop(a)
    reg.drop(None)
    assert calls == [("register", a.data_ptr()), ("register", b.data_ptr()),
                     ("unregister", a.data_ptr())]
    driver.refuse, calls[:] = True, []
    refused = _Registered()
    with caplog.at_level(logging.WARNING, logger="distrun"):
        refused.add(a)
        refused.add(b)
    refused.drop(a)
    assert calls == [("register", a.data_ptr())]
    said = [r.getMessage() for r in caplog.records if "registered with CUDA" in r.getMessage()]
    assert len(said) == 1 and "error 1" in said[0] and "pageable speed" in said[0], said
