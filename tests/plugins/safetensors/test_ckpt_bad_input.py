"""Bad checkpoints and bad `distrun ckpt` arguments (issue 15): exit 2, exactly one line on
stderr, nothing written, nothing read outside the checkpoint root. Each case damages a fresh
two-step checkpoint folder and runs one `distrun ckpt` command in-process.

Also the path rule: nothing of a checkpoint is read through a link that leaves its checkpoint
root (``manifest.json`` linked out, a ``step-N`` linked to a folder outside ``checkpoints/``),
while an explicit ``--resume PATH`` outside the run is loaded (the user asked for it)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
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
    """tmp_path/run/checkpoints with step-1 and step-2 (latest), and an empty tmp_path/outside."""
    root = tmp_path / "run" / "checkpoints"
    model, opt = build("plain")
    saver = Checkpointer(str(root))
    for step in (1, 2):
        train_step(model, opt, step)
        saver.save(step, model, opt, {"progress": {"step": step}})
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
            "error: 1 of 1 checkpoint(s) failed verification")


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


CASES: list[Callable[[Path], tuple[list[str], str]]] = [
    dtype_is_a_list, committed_at_not_a_number, committed_at_a_list,
    latest_names_a_missing_step, shard_size_dots, shard_size_two_dots, manifest_linked_out,
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
