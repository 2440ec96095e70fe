"""Damaged and hostile checkpoints: one clear error naming the file, nothing read outside the
folder, nothing loaded half-way. "Resealed" cases also fix the manifest's size and checksum,
so the deeper checks (headers, index) are the ones that must catch the damage."""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path

import pytest
import torch
from st_layouts import build, compare, full_state, reseal, train_step

from distrun_safetensors.files import CheckpointError
from distrun_safetensors.load import load
from distrun_safetensors.save import Checkpointer

MODEL_FILE = "model-00001-of-00001.safetensors"
_opened: list[str] | None = None


def _audit(event, args):
    if _opened is not None and event == "open" and isinstance(args[0], (str, bytes)):
        _opened.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


@pytest.fixture
def ckpt(tmp_path):
    model, opt = build("plain")
    train_step(model, opt, 1)
    saver = Checkpointer(str(tmp_path / "ckpt"))
    path = saver.save(1, model, opt, {"progress": {"step": 1}})
    # the pruning after the commit runs on in a thread and looks at the folder's commit lock:
    # the tests record every file opened while they load, so it must be over first
    saver.wait()
    return path


def _header(folder, name=MODEL_FILE):
    raw = Path(os.path.join(folder, name)).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:], n


def _write_header(folder, header, data, n, name=MODEL_FILE):
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    text += b" " * (n - len(text))
    Path(os.path.join(folder, name)).write_bytes(struct.pack("<Q", n) + text + data)
    reseal(folder, name)


def _edit_index(folder, fn):
    path = os.path.join(folder, "model.safetensors.index.json")
    index = json.loads(Path(path).read_text())
    fn(index)
    Path(path).write_text(json.dumps(index))
    reseal(folder, "model.safetensors.index.json")


def truncated(folder):
    path = os.path.join(folder, MODEL_FILE)
    os.truncate(path, os.path.getsize(path) - 5)
    return f"{MODEL_FILE} is"


def truncated_resealed(folder):
    truncated(folder)
    reseal(folder, MODEL_FILE)
    return f"{MODEL_FILE}: data section"


def flipped(folder):
    path = os.path.join(folder, MODEL_FILE)
    raw = bytearray(Path(path).read_bytes())
    raw[len(raw) // 2] ^= 0x40
    Path(path).write_bytes(bytes(raw))
    return f"{MODEL_FILE}: checksum mismatch"


def header_too_long(folder):
    path = os.path.join(folder, MODEL_FILE)
    raw = Path(path).read_bytes()
    Path(path).write_bytes(struct.pack("<Q", len(raw) * 4) + raw[8:])
    reseal(folder, MODEL_FILE)
    return "is larger than the file"


def header_not_object(folder):
    _, data, n = _header(folder)
    _write_header(folder, [1, 2, 3], data, n)
    return f"{MODEL_FILE}: header is not a JSON object"


def dtype_disagrees(folder):
    header, data, n = _header(folder)
    header["fc1.weight"]["dtype"] = "I32"
    _write_header(folder, header, data, n)
    return "'fc1.weight' is I32[10, 7] but the index says F32[10, 7]"


def shape_disagrees(folder):
    header, data, n = _header(folder)
    header["fc1.weight"]["shape"] = [7, 10]
    _write_header(folder, header, data, n)
    return "'fc1.weight' is F32[7, 10] but the index says F32[10, 7]"


def escapes_dotdot(folder):
    _edit_index(folder, lambda ix: ix["weight_map"].update({"fc1.weight": "../x.safetensors"}))
    return "'../x.safetensors'"


def escapes_absolute(folder):
    _edit_index(folder, lambda ix: ix["weight_map"].update({"fc1.weight": "/etc/passwd"}))
    return "'/etc/passwd'"


def escapes_manifest(folder):
    path = os.path.join(folder, "manifest.json")
    manifest = json.loads(Path(path).read_text())
    manifest["files"]["../../outside.json"] = {"size": 2, "crc32": "0"}
    Path(path).write_text(json.dumps(manifest))
    return "'../../outside.json' in the checkpoint is not a plain file name"


def escapes_symlink(folder):
    outside = os.path.join(os.path.dirname(os.path.dirname(folder)), "outside.safetensors")
    os.replace(os.path.join(folder, MODEL_FILE), outside)
    os.symlink(outside, os.path.join(folder, MODEL_FILE))
    return f"{MODEL_FILE} is a link that leaves the checkpoint folder"


def missing_manifest(folder):
    os.unlink(os.path.join(folder, "manifest.json"))
    return "manifest.json is missing"


# -- issue 26: every file of the folder linked out; what verify now refuses, resume refuses ---


def _linked_out(name):
    def damage(folder):
        outside = os.path.join(os.path.dirname(os.path.dirname(folder)), name)
        os.replace(os.path.join(folder, name), outside)
        os.symlink(outside, os.path.join(folder, name))
        return f"{name} is a link that leaves the checkpoint folder"

    damage.__name__ = f"linked_out_{name.replace('.', '_').replace('-', '_')}"
    return damage


def _edit_json(folder, name, fn):
    path = os.path.join(folder, name)
    data = json.loads(Path(path).read_text())
    fn(data)
    Path(path).write_text(json.dumps(data))
    if name != "manifest.json":
        reseal(folder, name)


def state_holds_pickle(folder):
    import pickle

    Path(folder, "state-00000.json").write_bytes(pickle.dumps({"progress": {"step": 1}}))
    reseal(folder, "state-00000.json")
    return "state-00000.json: state is not valid JSON (corrupted)"


def state_bad_tensor_reference(folder):
    _edit_json(folder, "state-00000.json",
               lambda s: s["progress"].update(step={"__tensor__": "state.progress.step"}))
    return "progress.step refers to tensor 'state.progress.step', which is not stored"


def state_bad_inline_tensor(folder):
    _edit_json(folder, "state-00000.json", lambda s: s["progress"].update(
        step={"__inline__": {"dtype": "load", "shape": [1], "data": [1]}}))
    return "progress.step is a malformed inline tensor"


def state_path_outside(folder):
    _edit_json(folder, "manifest.json",
               lambda m: m["states"]["files"][0].update(json="../../outside.json"))
    return "file name '../../outside.json' in the checkpoint is not a plain file name"


def state_path_absolute(folder):
    _edit_json(folder, "manifest.json",
               lambda m: m["states"]["files"][0].update(json="/etc/passwd"))
    return "file name '/etc/passwd' in the checkpoint is not a plain file name"


def state_ranks_repeated(folder):
    _edit_json(folder, "manifest.json", lambda m: m["states"].update(
        ranks=[0] * len(m["states"]["files"]) + [1]))
    return "manifest is malformed (states: ranks, one distinct rank per entry)"


def dtype_lie_in_header_and_index(folder):
    header, data, n = _header(folder)
    header["fc1.weight"]["dtype"] = "I32"
    _write_header(folder, header, data, n)
    _edit_index(folder, lambda ix: ix["distrun"]["tensors"]["fc1.weight"].update(dtype="I32"))
    return "tensor 'fc1.weight' is I32[10, 7] but the manifest recorded F32[10, 7] at the commit"


def index_version_from_the_future(folder):
    _edit_index(folder, lambda ix: ix["distrun"].update(version=3))
    return "index version 3 was written by a newer distrun-safetensors; this build reads"


CASES = [truncated, truncated_resealed, flipped, header_too_long, header_not_object,
         dtype_disagrees, shape_disagrees, escapes_dotdot, escapes_absolute, escapes_manifest,
         escapes_symlink, missing_manifest, state_ranks_repeated,
         *[_linked_out(name) for name in ("model.safetensors.index.json",
                                          "optimizer.safetensors.index.json", "optimizer.json",
                                          "state-00000.json", "optim-00001-of-00001.safetensors")],
         state_holds_pickle, state_bad_tensor_reference, state_bad_inline_tensor,
         state_path_outside, state_path_absolute, dtype_lie_in_header_and_index,
         index_version_from_the_future]


@pytest.mark.parametrize("damage", CASES, ids=[c.__name__ for c in CASES])
def test_bad_checkpoint_gives_one_clear_error_and_changes_nothing(ckpt, damage, monkeypatch):
    global _opened
    expected = damage(ckpt)
    model, opt = build("plain", seed=4)
    train_step(model, opt, 2)
    before = full_state(model, opt)
    import safetensors

    real = safetensors.safe_open

    def spy(path, *a, **kw):
        _opened.append(os.fspath(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(safetensors, "safe_open", spy)
    _opened = []
    try:
        with pytest.raises(CheckpointError) as info:
            load(ckpt, model, opt)
        opened = list(_opened)
    finally:
        _opened = None
    message = str(info.value)
    assert expected in message, message
    assert "\n" not in message
    assert compare(full_state(model, opt), before) == []
    root = os.path.realpath(ckpt)
    outside = [p for p in opened if not os.path.realpath(p).startswith(root + os.sep)
               and "site-packages" not in p and "/lib/python" not in p]
    assert outside == [], outside


def test_model_with_other_names_or_shapes_is_refused_naming_them(ckpt):
    other = torch.nn.Sequential(torch.nn.Linear(7, 10))
    with pytest.raises(CheckpointError) as info:
        load(ckpt, other)
    assert "missing from the checkpoint: 0.weight, 0.bias" in str(info.value)
    assert "not in the model: scale, fc1.weight, fc1.bias" in str(info.value)
    model, _ = build("plain")
    model.fc1 = torch.nn.Linear(7, 12)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        load(ckpt, model)
    assert "fc1.weight: checkpoint F32[10, 7] vs model float32[12, 7]" in str(info.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
