"""Bad checkpoints and bad `distrun ckpt` arguments (issue 15): exit 2, exactly one line on
stderr, nothing written, nothing read outside the checkpoint root. Each case damages a fresh
two-step checkpoint folder and runs one `distrun ckpt` command in-process.

Also the path rule: nothing of a checkpoint is read through a link that leaves its checkpoint
root (``manifest.json`` linked out, a ``step-N`` linked to a folder outside ``checkpoints/``),
while an explicit ``--resume PATH`` outside the run is loaded (the user asked for it)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from st_layouts import build, reseal, train_step

from distrun_safetensors.files import CheckpointError
from distrun_safetensors.load import load
from distrun_safetensors.save import Checkpointer

INDEX = "model.safetensors.index.json"
_opened: list[str] | None = None


def _audit(event: str, args: tuple) -> None:
    if _opened is not None and event == "open" and isinstance(args[0], (str, bytes)):
        _opened.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


@pytest.fixture
def ckpts(tmp_path: Path) -> Path:
    """tmp_path/run/checkpoints with step-1 and step-2 (latest), each with a state tensor
    (so state-00000.safetensors exists), and an empty tmp_path/outside."""
    root = tmp_path / "run" / "checkpoints"
    model, opt = build("plain")
    saver = Checkpointer(str(root))
    for step in (1, 2):
        train_step(model, opt, step)
        saver.save(step, model, opt, {"progress": {"step": step},
                                      "extra": {"t": torch.arange(3)}})
    # the pruning after a commit runs on in a thread and may still touch the folder: the
    # tests compare the tree before and after a command, so it must be over first
    saver.wait()
    (tmp_path / "outside").mkdir()
    return root


# -- the cases: each damages the folder and returns (command args, the exact error line) -----


def dtype_is_a_list(c: Path) -> tuple[list[str], str]:
    step = c / "step-2"
    index = json.loads((step / INDEX).read_text())
    name = next(iter(index["distrun"]["tensors"]))
    index["distrun"]["tensors"][name]["dtype"] = ["F32"]
    (step / INDEX).write_text(json.dumps(index))
    reseal(step, INDEX)
    return (["inspect", str(step)],
            f"error: {step / INDEX}: tensor {name!r} is described badly (dtype, shape or pieces)")


def committed_at_not_a_number(c: Path) -> tuple[list[str], str]:
    step = c / "step-2"
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["committed_at"] = "yesterday"
    (step / "manifest.json").write_text(json.dumps(manifest))
    return (["inspect", str(step)],
            f"error: {step / 'manifest.json'}: manifest is malformed (committed_at 'yesterday' "
            "is not a time in seconds)")


def committed_at_a_list(c: Path) -> tuple[list[str], str]:
    step = c / "step-2"
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["committed_at"] = [1, 2]
    (step / "manifest.json").write_text(json.dumps(manifest))
    return (["verify", str(step)],
            f"error: {step / 'manifest.json'}: manifest is malformed (committed_at '[1, 2]' is "
            "not a time in seconds)")


def latest_names_a_missing_step(c: Path) -> tuple[list[str], str]:
    (c / "latest").write_text("step-9")
    return (["ls", str(c)],
            f"error: {c / 'latest'} names step-9, which does not exist (--resume latest falls "
            "back to the newest valid checkpoint; delete the file or point it at one of the "
            "folders listed)")


def shard_size_dots(c: Path) -> tuple[list[str], str]:
    out = c.parent.parent / "merged"
    return (["consolidate", str(c / "step-2"), str(out), "--max-shard-size", "..."],
            "error: Invalid value: '...' is not a size (examples: 2GB, 500MB, 1GiB) "
            "(see `distrun ckpt consolidate --help`)")


def shard_size_two_dots(c: Path) -> tuple[list[str], str]:
    out = c.parent.parent / "merged"
    return (["consolidate", str(c / "step-2"), str(out), "--max-shard-size", "1.2.3GB"],
            "error: Invalid value: '1.2.3GB' is not a size (examples: 2GB, 500MB, 1GiB) "
            "(see `distrun ckpt consolidate --help`)")


def manifest_linked_out(c: Path) -> tuple[list[str], str]:
    step = c / "step-2"
    outside = c.parent.parent / "outside" / "manifest.json"
    os.replace(step / "manifest.json", outside)
    os.symlink(outside, step / "manifest.json")
    return (["inspect", str(step)],
            f"error: {step / 'manifest.json'} is a link that leaves the checkpoint folder "
            "(refusing to read it)")


# -- issue 26, item 4: every kind of file of the folder, as a link that leaves it (or a FIFO) --

LINKED = "is a link that leaves the checkpoint folder (refusing to read it)"


def _link_out(c: Path, rel: str) -> Path:
    """Move file ``rel`` of the checkpoints folder outside and leave a symlink to it."""
    path = c / rel
    target = c.parent.parent / "outside" / path.name
    os.replace(path, target)
    os.symlink(target, path)
    return path


def latest_linked_out(c: Path) -> tuple[list[str], str]:
    path = _link_out(c, "latest")
    return ["inspect", str(path)], f"error: {path} {LINKED}"


def best_linked_out(c: Path) -> tuple[list[str], str]:
    (c.parent.parent / "outside" / "best").write_text("step-1\n")
    os.symlink(c.parent.parent / "outside" / "best", c / "best")
    return ["verify", str(c / "best")], f"error: {c / 'best'} {LINKED}"


def model_index_linked_out(c: Path) -> tuple[list[str], str]:
    path = _link_out(c, f"step-2/{INDEX}")
    return ["verify", str(c / "step-2")], f"error: {path} {LINKED}"


def optimizer_index_linked_out(c: Path) -> tuple[list[str], str]:
    path = _link_out(c, "step-2/optimizer.safetensors.index.json")
    return ["inspect", str(c / "step-2")], f"error: {path} {LINKED}"


def optimizer_json_linked_out(c: Path) -> tuple[list[str], str]:
    path = _link_out(c, "step-2/optimizer.json")
    return ["verify", str(c / "step-2")], f"error: {path} {LINKED}"


def state_json_linked_out(c: Path) -> tuple[list[str], str]:
    path = _link_out(c, "step-2/state-00000.json")
    return ["verify", str(c / "step-2")], f"error: {path} {LINKED}"


def state_tensors_linked_out(c: Path) -> tuple[list[str], str]:
    path = _link_out(c, "step-2/state-00000.safetensors")
    out = c.parent.parent / "merged"
    return ["consolidate", str(c / "step-2"), str(out)], f"error: {path} {LINKED}"


def latest_is_a_fifo(c: Path) -> tuple[list[str], str]:
    (c / "latest").unlink()
    os.mkfifo(c / "latest")  # reading it would block forever
    return (["ls", str(c)],
            f"error: {c / 'latest'} is not a regular file (refusing to read it)")


def manifest_is_a_fifo(c: Path) -> tuple[list[str], str]:
    step = c / "step-2"
    (step / "manifest.json").unlink()
    os.mkfifo(step / "manifest.json")
    return (["inspect", str(step)],
            f"error: {step / 'manifest.json'} is not a regular file (refusing to read it)")


# -- item 6: what a resume refuses, verify / inspect / consolidate refuse too ------------------


def _edit(step: Path, name: str, fn: Callable[[dict], None]) -> None:
    data = json.loads((step / name).read_text())
    fn(data)
    (step / name).write_text(json.dumps(data))
    if name != "manifest.json":
        reseal(step, name)


def state_json_holds_pickle(c: Path) -> tuple[list[str], str]:
    step = c / "step-2"
    (step / "state-00000.json").write_bytes(pickle.dumps({"progress": {"step": 2}}))
    reseal(step, "state-00000.json")
    return (["verify", str(step)],
            f"error: {step / 'state-00000.json'}: state is not valid JSON (corrupted)")


def state_refers_to_a_missing_tensor(c: Path) -> tuple[list[str], str]:
    step = c / "step-2"
    _edit(step, "state-00000.json",
          lambda s: s["extra"].update({"t": {"__tensor__": "state.nope"}}))
    return (["verify", str(step)],
            f"error: {step / 'state-00000.json'}: extra.t refers to tensor 'state.nope', which "
            "state-00000.safetensors does not hold")


def optimizer_refers_to_a_missing_tensor(c: Path) -> tuple[list[str], str]:
    step = c / "step-2"
    _edit(step, "optimizer.json", lambda o: o["state"]["fc1.weight"].update(
        {"exp_avg": {"__tensor__": "fc9.weight/exp_avg"}}))
    return (["inspect", str(step)],
            f"error: {step / 'optimizer.json'}: state fc1.weight.exp_avg refers to tensor "
            "'fc9.weight/exp_avg', which the optimizer index does not hold")


def _state_path(c: Path, name: str) -> tuple[Path, str]:
    step = c / "step-2"
    _edit(step, "manifest.json", lambda m: m["states"]["files"][0].update({"json": name}))
    return step, (f"error: {step}: file name {name!r} in the checkpoint is not a plain file "
                  "name inside the folder (refusing to read outside the checkpoint)")


def state_path_outside(c: Path) -> tuple[list[str], str]:
    step, line = _state_path(c, "../../outside/state-00000.json")
    return ["verify", str(step)], line


def state_path_absolute(c: Path) -> tuple[list[str], str]:
    step, line = _state_path(c, "/etc/passwd")
    return ["inspect", str(step)], line


def dtype_lie_in_header_and_index(c: Path) -> tuple[list[str], str]:
    """fc1.weight's F32 bytes relabelled I32 (same width) in its file and in the index."""
    step = c / "step-2"
    data = step / "model-00001-of-00001.safetensors"
    raw = data.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = raw[8:8 + n].replace(b'"fc1.weight":{"dtype":"F32"', b'"fc1.weight":{"dtype":"I32"')
    assert header != raw[8:8 + n]
    data.write_bytes(raw[:8] + header + raw[8 + n:])
    reseal(step, data.name)
    _edit(step, INDEX, lambda ix: ix["distrun"]["tensors"]["fc1.weight"].update(dtype="I32"))
    out = c.parent.parent / "merged"
    return (["consolidate", str(step), str(out)],
            f"error: {step / INDEX}: tensor 'fc1.weight' is I32[10, 7] but the manifest "
            "recorded F32[10, 7] at the commit (the index and its files were changed after "
            "the save)")


NEWER = ("was written by a newer distrun-safetensors; this build reads versions 1 to 2 "
         "(pip install -U distrun-safetensors)")


def manifest_version_from_the_future(c: Path) -> tuple[list[str], str]:
    step = c / "step-2"
    _edit(step, "manifest.json", lambda m: m.update(version=3))
    return ["verify", str(step)], f"error: {step / 'manifest.json'}: format version 3 {NEWER}"


def index_version_from_the_future(c: Path) -> tuple[list[str], str]:
    step = c / "step-2"
    _edit(step, INDEX, lambda ix: ix["distrun"].update(version=3))
    return ["verify", str(step)], f"error: {step / INDEX}: index version 3 {NEWER}"


def index_format_version_from_the_future(c: Path) -> tuple[list[str], str]:
    step = c / "step-2"
    _edit(step, "optimizer.safetensors.index.json",
          lambda ix: ix["metadata"].update(format_version=7))
    out = c.parent.parent / "merged"
    return (["consolidate", str(step), str(out)],
            f"error: {step / 'optimizer.safetensors.index.json'}: index format_version 7 "
            + NEWER)


# -- item 11: a pointer given to a command is followed, safely -------------------------------


def pointer_names_a_missing_step(c: Path) -> tuple[list[str], str]:
    (c / "latest").write_text("step-9\n")
    return (["inspect", str(c / "latest")],
            f"error: {c / 'latest'} names step-9, which does not exist")


def pointer_names_no_step(c: Path) -> tuple[list[str], str]:
    (c / "latest").write_text("hello\n")
    out = c.parent.parent / "merged"
    return (["consolidate", str(c / "latest"), str(out)],
            f"error: {c / 'latest'} does not name a step-N folder ('hello')")


def pointer_names_a_step_linked_out(c: Path) -> tuple[list[str], str]:
    _step_linked_out(c)
    return (["verify", str(c / "latest")],
            f"error: {c / 'latest'} names step-7, a link that leaves {c} (not followed; give "
            "that folder itself)")


CASES: list[Callable[[Path], tuple[list[str], str]]] = [
    dtype_is_a_list, committed_at_not_a_number, committed_at_a_list,
    latest_names_a_missing_step, shard_size_dots, shard_size_two_dots, manifest_linked_out,
    # issue 26
    latest_linked_out, best_linked_out, model_index_linked_out, optimizer_index_linked_out,
    optimizer_json_linked_out, state_json_linked_out, state_tensors_linked_out,
    latest_is_a_fifo, manifest_is_a_fifo,
    state_json_holds_pickle, state_refers_to_a_missing_tensor,
    optimizer_refers_to_a_missing_tensor, state_path_outside, state_path_absolute,
    dtype_lie_in_header_and_index, manifest_version_from_the_future,
    index_version_from_the_future, index_format_version_from_the_future,
    pointer_names_a_missing_step, pointer_names_no_step, pointer_names_a_step_linked_out,
]


#: this checkout (the editable installs' sources and metadata live in it)
REPO = str(Path(__file__).resolve().parents[3])


def _tree(root: Path) -> dict[str, float]:
    return {str(p): p.lstat().st_mtime for p in root.rglob("*")}


def _outside_reads(opened: list[str], root: Path) -> list[str]:
    """Opened paths outside the checkpoint root that are not Python's own files."""
    real = os.path.realpath(root)
    ok = (real + os.sep, os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix),
          "/dev/", "/proc/", "/sys/", "/etc/", REPO + os.sep)
    return [p for p in opened if not os.path.realpath(p).startswith(ok)]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_bad_checkpoint_input_is_one_line_exit_2(cli, ckpts, case):
    global _opened
    args, expected = case(ckpts)
    before = _tree(ckpts.parent.parent)
    _opened = []
    try:
        result = cli("ckpt", *args, cwd=ckpts.parent.parent)
        opened = list(_opened)
    finally:
        _opened = None
    assert result.returncode == 2, result
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert lines == [expected], result
    assert "Traceback" not in result.output
    assert _tree(ckpts.parent.parent) == before  # nothing written
    assert _outside_reads(opened, ckpts) == []  # nothing read outside


def _step_linked_out(ckpts: Path) -> Path:
    """step-7 -> tmp_path/outside/step-7: a valid checkpoint folder outside checkpoints/."""
    target = ckpts.parent.parent / "outside" / "step-7"
    shutil.copytree(ckpts / "step-2", target)
    os.symlink(target, ckpts / "step-7")
    (ckpts / "latest").write_text("step-7")
    return target


def test_ls_never_reads_a_step_linked_out_of_the_checkpoint_folder(cli, ckpts):
    global _opened
    target = _step_linked_out(ckpts)
    _opened = []
    try:
        result = cli("ckpt", "ls", str(ckpts))
        opened = list(_opened)
    finally:
        _opened = None
    assert [p for p in opened if str(target) in os.path.realpath(p)] == []
    assert f"warning: {ckpts / 'step-7'} is a link that leaves {ckpts}" in result.stderr
    assert "step-7" not in result.stdout
    assert "step-2" in result.stdout and "step-1" in result.stdout


def test_resume_latest_skips_a_linked_out_step_but_an_explicit_path_loads(ckpts):
    global _opened
    target = _step_linked_out(ckpts)
    model, opt = build("plain", seed=5)
    _opened = []
    try:
        result = load("latest", model, opt, ckpt_dir=str(ckpts))
        opened = list(_opened)
    finally:
        _opened = None
    assert result is not None and os.path.basename(result.path) == "step-2"
    assert [p for p in opened if str(target) in os.path.realpath(p)] == []
    # --resume PATH: the user named the folder outside the run; it loads.
    explicit = load(str(target), model, opt)
    assert explicit is not None and explicit.step == 2


def test_manifest_linked_out_is_refused_before_it_is_opened(ckpts):
    global _opened
    manifest_linked_out(ckpts)
    model, opt = build("plain", seed=5)
    _opened = []
    try:
        with pytest.raises(CheckpointError, match="is a link that leaves the checkpoint folder"):
            load(str(ckpts / "step-2"), model, opt)
        result = load("latest", model, opt, ckpt_dir=str(ckpts))  # falls back to step-1
        opened = list(_opened)
    finally:
        _opened = None
    assert result is not None and result.step == 1
    outside = str(ckpts.parent.parent / "outside")
    assert [p for p in opened if os.path.realpath(p).startswith(outside)] == []
