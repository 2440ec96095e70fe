"""What a checkpoint folder survives, as a user meets it (issue 36): another run's folder given
as --ckpt-dir, a full disk during a save, a kill while old checkpoints are pruned, edited state
values with fixed checksums, a flipped data byte under `ckpt inspect`, `ckpt consolidate` into
a folder that cannot be written. Each is one line and exit 2 where the user must act, and no
checkpoint is ever overwritten, pruned or left half-deleted silently."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from st_layouts import build, reseal, train_step

from distrun import testing
from distrun.testing import run_cli

HERE = Path(__file__).resolve().parent
TASK = f"{HERE / 'st_task.py'}:Task"
#: a full disk is met, not simulated: a tmpfs this small holds the folder's small files and one
#: checkpoint of the tiny task (~92 KB on tmpfs pages), not the files of a second one (64 KB)
SMALL_DISK = "140k"


def _env(**extra: str) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
            "DISTRUN_PLUGINS": "st_plugin", "DISTRUN_TIMEOUT": "120", **extra}


def _args(run_dir: Path, *flags: str) -> list[str]:
    return ["run", "--nproc-per-node", "2", "--strategy", "st_ddp", "--batch-size", "8",
            "--seed", "3", "--ckpt-every-n-steps", "2", "--run-dir", str(run_dir), *flags, TASK]


def _train(run_dir: Path, *flags: str):
    return run_cli(*_args(run_dir, "--max-epochs", "3", *flags), env=_env(), timeout=400)


def _tree(root: Path) -> dict[str, float]:
    """Every entry under ``root`` with its mtime, but the run lock each launcher rewrites."""
    return {str(p): p.lstat().st_mtime_ns for p in root.rglob("*") if p.name != ".distrun-lock"}


# -- item 17: another run's checkpoint folder ----------------------------------------------------


@pytest.mark.slow
def test_a_run_that_does_not_continue_a_folder_of_checkpoints_is_refused(tmp_path):
    """Run a's checkpoints in a shared --ckpt-dir: run b, fresh, would have written its step-1..3
    there and moved `latest` (a's `--resume auto` then loaded b's step-3 and pruned its own).
    It is refused in one line before it trains, and so is a second start of a without --resume
    (the folder cannot tell it from a stranger); a's --resume auto continues."""
    shared = tmp_path / "shared"
    first = _train(tmp_path / "a", "--max-steps", "4", "--ckpt-dir", str(shared))
    assert first.returncode == 0, first
    assert sorted(p.name for p in shared.glob("step-*")) == ["step-2", "step-4"]
    before = _tree(shared)
    line = (f"error: the checkpoint folder {shared} holds checkpoints of another run (step-4, "
            "step-2) and this run starts fresh (no --resume): its saves would replace their "
            "latest and prune them; run with --resume auto to continue that run, give this run "
            f"another --ckpt-dir, or remove {shared}")
    for run_dir in ("b", "a"):  # a stranger, then the same command again without --resume
        refused = _train(tmp_path / run_dir, "--max-steps", "3", "--ckpt-every-n-steps", "1",
                         "--ckpt-dir", str(shared))
        assert refused.returncode == 2, refused
        assert [ln for ln in refused.stderr.splitlines() if ln.startswith("error")] == [line]
        assert "Traceback" not in refused.output and "step 1/" not in refused.output, refused
        assert _tree(shared) == before  # nothing written, nothing pruned
    resumed = _train(tmp_path / "a", "--max-steps", "6", "--ckpt-dir", str(shared),
                     "--ckpt-keep-last", "2", "--resume", "auto")
    assert resumed.returncode == 0, resumed
    assert f"Resumed from {shared / 'step-4'} at step 4" in resumed.output
    assert (shared / "latest").read_text().strip() == "step-6"
    assert sorted(p.name for p in shared.glob("step-*")) == ["step-4", "step-6"]


# -- item 8: a full checkpoint folder ----------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real tmpfs of :data:`SMALL_DISK` (root only), unmounted when the test ends."""
    with testing.small_disk(tmp_path / "disk", SMALL_DISK) as disk:
        yield disk


@pytest.mark.slow
def test_a_full_checkpoint_folder_stops_the_run_in_one_line_and_latest_stays(small_disk,
                                                                              tmp_path):
    """The step-2 checkpoint fits, the step-4 one does not: the run stops (a Lightning user
    expects a failed checkpoint write to fail the run, not to train on without checkpoints)
    with one line naming the full folder; `latest` names step-2, which verifies; the failed
    save left nothing behind."""
    result = _train(tmp_path / "run", "--max-steps", "8", "--ckpt-dir", str(small_disk))
    assert result.returncode == 2, result
    assert "Traceback" not in result.output, result
    lines = result.stderr.splitlines()
    # the rank whose write found the disk full, or both when both did (they write at once)
    full = (rf"rank [01]: the disk is full: No space left on device "
            rf"\({re.escape(str(small_disk))}/\.tmp-step-4-[0-9a-f]{{8}}/[\w.-]+\)")
    assert len(lines) == 1 and re.fullmatch(
        rf"error: checkpoint step 4 was not saved: {full}(; {full})?; free "
        rf"space in {re.escape(str(small_disk))} or give --ckpt-dir a folder with room for the "
        r"checkpoints \(latest still names step-2, which is intact\)", lines[0]), lines
    assert (small_disk / "latest").read_text() == "step-2\n"
    verified = run_cli("ckpt", "verify", str(small_disk / "latest"), env=_env())
    assert verified.returncode == 0 and verified.stdout.startswith(
        f"OK  {small_disk / 'step-2'}: step 2"), verified
    assert sorted(os.listdir(small_disk)) == [".distrun-lock", ".generation", "latest",
                                              "step-2"]


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MB tmpfs (root only), unmounted when the test ends."""
    with testing.small_disk(tmp_path / "tmpfs", "1m") as disk:
        yield disk


def test_a_disk_full_at_any_point_of_a_save_leaves_the_previous_checkpoint(tmpfs):
    """A save of step-2 from code (``Checkpointer``) with 0, 1, 2, ... pages left on the disk:
    each allocation of the save in turn finds the disk full (the lock, every file, the
    manifest, the new ``latest`` after the folder was renamed into place) until one fits. Each
    failure is one line saying so, and leaves the folder as it was: ``latest`` names step-1,
    which verifies, and nothing of the failed save is left."""
    from distrun_safetensors.errors import CheckpointError
    from distrun_safetensors.save import Checkpointer
    from distrun_safetensors.validation import validate

    directory = tmpfs / "checkpoints"
    model, opt = build("plain")
    saver = Checkpointer(str(directory))
    train_step(model, opt, 1)
    saver.save(1, model, opt, {"progress": {"step": 1}})
    saver.wait()
    before = sorted(os.listdir(directory))
    filler, said = tmpfs / "filler", []
    for left in range(64):
        disk = os.statvfs(tmpfs)
        filler.write_bytes(bytes((disk.f_bavail - left) * disk.f_frsize))
        try:
            saver.save(2, model, opt, {"progress": {"step": 2}})
            saver.wait()
            break
        except CheckpointError as exc:
            said.append(str(exc))
        finally:
            filler.unlink()
        assert "\n" not in said[-1] and re.fullmatch(
            r"checkpoint step 2 was not saved: .*No space left on device.*; free space in "
            rf"{re.escape(str(directory))} or give --ckpt-dir a folder with room for the "
            r"checkpoints \(latest still names step-1, which is intact\)", said[-1]), said[-1]
        assert (directory / "latest").read_text() == "step-1\n"
        validate(str(directory / "step-1"))
        assert sorted(os.listdir(directory)) == before, said[-1]  # nothing of it left
    else:
        pytest.fail("the save never fit")
    assert len(said) > 5 and f"({directory}/.latest-" in said[-1], said
    assert (directory / "latest").read_text() == "step-2\n"


# -- item 20: a kill while pruning -------------------------------------------------------------

#: files added to the checkpoint the pruning removes, so that removing it takes a while
PADDING = 8000


@pytest.mark.slow
def test_a_kill_while_pruning_leaves_no_half_deleted_checkpoint(tmp_path):
    """`--ckpt-keep-last 1`: the first save of a resumed run prunes step-2 in the background;
    the run is killed (-9, launcher and workers) once that removal has begun. No step-N is
    left half-deleted: `ckpt verify` passes on the folder, `ckpt ls` shows the unfinished
    removal and `ckpt clean` finishes it."""
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    first = _train(run_dir, "--max-steps", "2")
    assert first.returncode == 0, first
    step2 = ckpts / "step-2"
    for i in range(PADDING):  # not in the manifest: a checkpoint stays valid with them
        (step2 / f"pad-{i:05d}").touch()
    whole = len(os.listdir(step2))
    command = [sys.executable, "-m", "distrun",
               *_args(run_dir, "--max-steps", "400", "--max-epochs", "100",
                      "--ckpt-keep-last", "1", "--resume", "latest")]
    with open(tmp_path / "out.txt", "w") as out:
        proc = subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1", **_env()},
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                begun = len(os.listdir(step2)) < whole
            except FileNotFoundError:
                begun = True
            if begun:
                break
            time.sleep(0.001)
        else:
            pytest.fail(f"the pruning of step-2 never began: {(tmp_path / 'out.txt').read_text()}")
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(60)
    assert not step2.exists() or len(os.listdir(step2)) == whole, "step-2 half-deleted"
    trash = [n for n in os.listdir(ckpts) if n.startswith(".pruned-")]
    verified = run_cli("ckpt", "verify", str(ckpts), env=_env())
    assert verified.returncode == 0 and "BAD" not in verified.stdout, verified
    listing = run_cli("ckpt", "ls", str(ckpts), env=_env())
    cleaned = run_cli("ckpt", "clean", str(ckpts), env=_env())
    assert cleaned.returncode == 0, cleaned
    for name in trash:  # the kill landed while it was being removed (almost always)
        assert f"{name:<16} a pruned checkpoint whose removal was cut short" in listing.stdout
        assert f"removed {name}: a pruned checkpoint whose removal was cut short" \
            in cleaned.stdout
    assert not [n for n in os.listdir(ckpts) if n.startswith((".pruned-", ".tmp-"))]


# -- item 20: forged progress, inspect, consolidate ---------------------------------------------


def _forge(folder: Path, name: str, **progress: int) -> Path:
    """Set ``progress`` values in a state file and fix the manifest's checksum of it."""
    path = folder / name
    state = json.loads(path.read_text())
    state["progress"].update(progress)
    path.write_text(json.dumps(state))
    reseal(folder, name)
    return path


@pytest.mark.slow
def test_forged_progress_with_fixed_checksums_is_refused_naming_file_and_key(tmp_path):
    """step-4's state-00000.json says step -5, its checksum fixed: `--resume PATH` and `ckpt
    verify` refuse it in one line naming the file and the key; `--resume latest` skips it for
    step-2 with a warning (as for any damaged checkpoint), never resuming "at step -5"."""
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    assert _train(run_dir, "--max-steps", "4").returncode == 0
    forged = _forge(ckpts / "step-4", "state-00000.json", step=-5)
    line = (f"error: {forged}: progress.step is -5, not a whole number >= 0 (the state was "
            "changed after the save)")
    verify = run_cli("ckpt", "verify", str(ckpts / "step-4"), env=_env())
    assert (verify.returncode, verify.stderr) == (2, line + "\n"), verify
    explicit = _train(run_dir, "--max-steps", "6", "--resume", str(ckpts / "step-4"))
    assert explicit.returncode == 2, explicit
    assert explicit.stderr.splitlines() == [line], explicit
    latest = _train(run_dir, "--max-steps", "6", "--resume", "latest")
    assert latest.returncode == 0, latest
    assert f"skipping {ckpts / 'step-4'}: {forged}: progress.step is -5" in latest.output
    assert f"Resumed from {ckpts / 'step-2'} at step 2" in latest.output
    assert "at step -5" not in latest.output


@pytest.fixture
def ckpts(tmp_path: Path) -> Path:
    """tmp_path/checkpoints with step-1 and step-2 (latest), saved from code."""
    from distrun_safetensors.save import Checkpointer

    root = tmp_path / "checkpoints"
    model, opt = build("plain")
    saver = Checkpointer(str(root))
    for step in (1, 2):
        train_step(model, opt, step)
        saver.save(step, model, opt, {"progress": {"step": step}})
    saver.wait()
    return root


@pytest.mark.parametrize("value", [-1, 2.5, "3", True])
def test_verify_refuses_a_counter_that_is_not_a_whole_number(cli, ckpts, value):
    forged = _forge(ckpts / "step-2", "state-00000.json", samples=value)
    result = cli("ckpt", "verify", str(ckpts / "step-2"))
    assert result.returncode == 2, result
    assert result.stderr == (f"error: {forged}: progress.samples is {value!r}, not a whole "
                             "number >= 0 (the state was changed after the save)\n"), result


def test_inspect_says_it_did_not_verify_the_data_and_verify_finds_the_flip(cli, ckpts):
    """A flipped data byte passes `inspect` (metadata only), which says so and names `ckpt
    verify`; `inspect --verify` and `verify` name the file."""
    data = ckpts / "step-2" / "model-00001-of-00001.safetensors"
    good = data.read_bytes()
    raw = bytearray(good)
    raw[-2] ^= 0xFF
    data.write_bytes(bytes(raw))
    step = str(ckpts / "step-2")
    shown = cli("ckpt", "inspect", step)
    assert shown.returncode == 0, shown
    assert f"metadata checked, data not verified: run `distrun ckpt verify {step}`" \
        in shown.stdout
    assert json.loads(cli("ckpt", "inspect", "--json", step).stdout)["checksums_verified"] \
        is False
    line = f"error: {data}: checksum mismatch (corrupted file)\n"
    for args in (["inspect", "--verify", step], ["verify", step]):
        result = cli("ckpt", *args)
        assert (result.returncode, result.stderr) == (2, line), result
    data.write_bytes(good)
    assert "; checksums verified" in cli("ckpt", "inspect", "--verify", step).stdout


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[Path]:
    """A real read-only filesystem (a tmpfs remounted ro; root only), unmounted at the end."""
    with testing.small_disk(tmp_path / "ro", "1m") as disk:
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        yield disk


def test_consolidate_into_a_read_only_folder_is_one_line(cli, ckpts, read_only):
    out = read_only / "hf"
    result = cli("ckpt", "consolidate", str(ckpts), str(out))
    assert result.returncode == 2, result
    assert result.stderr == (f"error: cannot write {out}: Read-only file system ({out}.partial); "
                             "choose an output folder on a disk you can write to, with room "
                             "for the model\n"), result
    assert os.listdir(read_only) == []


def test_consolidate_under_a_file_is_one_line_and_leaves_nothing(cli, ckpts, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = blocker / "hf"
    result = cli("ckpt", "consolidate", str(ckpts), str(out))
    assert result.returncode == 2, result
    assert result.stderr == (f"error: cannot write {out}: Not a directory ({out}.partial); "
                             "choose an output folder on a disk you can write to, with room "
                             "for the model\n"), result
    assert blocker.read_text() == ""
