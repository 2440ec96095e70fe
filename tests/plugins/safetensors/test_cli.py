"""As a user would: `distrun run` on 2 ranks with checkpoints, a kill -9 during a save, resume,
and `distrun ckpt ls | inspect | verify | consolidate`."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from distrun.testing import run_cli

HERE = Path(__file__).resolve().parent
TASK = f"{HERE / 'st_task.py'}:Task"


def _env(**extra: str) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
            "DISTRUN_PLUGINS": "st_plugin", "DISTRUN_TIMEOUT": "120", **extra}


def _train(run_dir: Path, *flags: str, **env: str):
    return run_cli("run", "--nproc-per-node", "2", "--strategy", "st_ddp", "--batch-size", "8",
                   "--seed", "3", "--max-epochs", "3", "--ckpt-every-n-steps", "2",
                   "--run-dir", str(run_dir), *flags, TASK, env=_env(**env), timeout=400)


@pytest.mark.slow
def test_train_kill_resume_and_ckpt_commands(tmp_path):
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    first = _train(run_dir, "--max-steps", "4")
    assert first.returncode == 0, first
    assert sorted(os.listdir(ckpts)) == [".generation", "latest", "step-2", "step-4"]

    # rank 1 is killed (-9) right after writing its 2nd file of the step-6 save
    killed = _train(run_dir, "--max-steps", "8", "--resume", "latest",
                    ST_KILL_AT="2@1")
    assert killed.returncode != 0, killed
    assert (ckpts / "latest").read_text().strip() == "step-4"
    leftovers = [p for p in ckpts.iterdir() if p.name.startswith(".tmp-step-6-") and p.is_dir()]
    assert len(leftovers) == 1, sorted(ckpts.iterdir())
    verify = run_cli("ckpt", "verify", str(ckpts))
    assert verify.returncode == 0, verify
    assert "OK" in verify.stdout and "BAD" not in verify.stdout

    final = tmp_path / "final.safetensors"
    resumed = _train(run_dir, "--max-steps", "8", "--resume", "latest", ST_SAVE=str(final))
    assert resumed.returncode == 0, resumed
    assert f"Resumed from {ckpts / 'step-4'} at step 4" in resumed.output
    # the killed save's folder went when the next run started, before its own first save
    assert f"Removed {leftovers[0]}, left by a save that did not finish" in resumed.output
    assert not [p for p in ckpts.iterdir() if p.name.startswith(".tmp-step-")]
    assert (ckpts / "latest").read_text().strip() == "step-8"

    listing = run_cli("ckpt", "ls", str(run_dir))
    assert listing.returncode == 0, listing
    lines = listing.stdout.splitlines()
    assert lines[0].startswith("* step-8") and "2 rank(s)" in lines[0], listing.stdout

    shown = run_cli("ckpt", "inspect", str(ckpts / "step-8"))
    assert shown.returncode == 0, shown
    assert "step 8" in shown.stdout and "saved by 2 rank(s), strategy st_ddp" in shown.stdout
    assert "0.weight" in shown.stdout and "F32" in shown.stdout and "[32, 6]" in shown.stdout

    out = tmp_path / "hf"
    merged = run_cli("ckpt", "consolidate", str(ckpts), str(out), "--max-shard-size", "500B")
    assert merged.returncode == 0, merged
    from safetensors.torch import load_file

    index = json.loads((out / "model.safetensors.index.json").read_text())
    loaded = {}
    for shard in sorted(set(index["weight_map"].values())):
        loaded.update(load_file(str(out / shard)))
    want = load_file(str(final))
    assert set(loaded) == set(want) == set(index["weight_map"])
    assert all(torch.equal(loaded[k], want[k]) for k in want)

    # a flipped byte: verify names the file and fails; resume falls back with a warning
    broken = tmp_path / "broken"
    shutil.copytree(ckpts, broken)
    data = broken / "step-8" / "model-00001-of-00002.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-2] ^= 0xFF
    data.write_bytes(bytes(raw))
    bad = run_cli("ckpt", "verify", str(broken / "step-8"))
    assert bad.returncode == 2, bad
    assert bad.stderr == (f"error: {data}: checksum mismatch (corrupted file)\n"), bad
    every = run_cli("ckpt", "verify", str(broken))  # each checkpoint of the folder: OK or BAD
    assert every.returncode == 2, every
    assert f"BAD {broken / 'step-8'}: {data}: checksum mismatch" in every.stdout
    assert f"OK  {broken / 'step-6'}: step 6" in every.stdout
    assert every.stderr == "error: 1 of 3 checkpoint(s) failed verification\n", every


@pytest.mark.slow
def test_launcher_killed_during_a_save_leaves_a_save_that_clean_removes(tmp_path):
    """Issue 26 item 8: `kill -9` of the launcher while rank 0 writes the step-2 save (its
    workers die with it): the temporary folder and its lock stay, `ckpt ls` shows the save
    ABANDONED and `ckpt clean` removes it, leaving the checkpoints folder as before the save."""
    import time

    from distrun._launch.lifeline import pid_alive

    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    killed = _train(run_dir, "--max-steps", "4", ST_KILL_LAUNCHER_AT="1@0")
    assert killed.returncode == -9, killed
    left = sorted(p.name for p in ckpts.iterdir() if p.name != ".generation")
    assert len(left) == 2 and left[0].startswith(".tmp-step-2-") and left[1] == left[0] + ".lock"
    writer = json.loads((ckpts / left[1]).read_text())["pid"]
    deadline = time.monotonic() + 60  # the worker dies with its launcher (PR_SET_PDEATHSIG)
    while pid_alive(writer) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(writer)
    listing = run_cli("ckpt", "ls", str(run_dir))
    assert listing.returncode == 0, listing
    assert f"{left[0]:<16} step 2  ABANDONED: pid {writer} on this host is gone" in listing.stdout
    cleaned = run_cli("ckpt", "clean", str(run_dir))
    assert cleaned.returncode == 0, cleaned
    assert f"removed {left[0]}: pid {writer} on this host is gone" in cleaned.stdout
    assert os.listdir(ckpts) == [".generation"]  # the newest generation drawn (fencing)


@pytest.mark.slow
def test_resume_latest_without_checkpoint_is_one_clear_error(tmp_path):
    result = run_cli("run", "--resume", "latest", "--run-dir", str(tmp_path / "empty"),
                     "--max-steps", "1", TASK, env=_env(), timeout=300)
    assert result.returncode == 2, result
    assert "error: no checkpoint found in" in result.stderr
    assert "Traceback" not in result.output


def test_every_ckpt_command_follows_latest_and_best(cli, tmp_path):
    """Issue 26 item 11: `latest` and `best` are pointer files; given to inspect, verify,
    consolidate or ls they name the checkpoint to act on (read through the checked open)."""
    from st_layouts import build, train_step

    from distrun_safetensors.save import Checkpointer

    ckpts = tmp_path / "run" / "checkpoints"
    model, opt = build("plain")
    saver = Checkpointer(str(ckpts))
    for step in (1, 2):
        train_step(model, opt, step)
        saver.save(step, model, opt, {"progress": {"step": step}})
    (ckpts / "best").write_text("step-1\n")  # as --ckpt-monitor writes it
    for pointer, step in (("latest", 2), ("best", 1)):
        path = str(ckpts / pointer)
        shown = cli("ckpt", "inspect", path)
        assert shown.returncode == 0, shown
        assert f"checkpoint {ckpts / f'step-{step}'}" in shown.stdout
        assert f"  step {step}  reason user" in shown.stdout
        checked = cli("ckpt", "verify", path)
        assert checked.returncode == 0, checked
        assert checked.stdout.startswith(f"OK  {ckpts / f'step-{step}'}: step {step}, ")
        listed = cli("ckpt", "ls", path)
        assert listed.returncode == 0, listed
        lines = listed.stdout.splitlines()
        assert len(lines) == 1 and lines[0].split()[:3] == (
            ["*", "step-2", "step"] if step == 2 else ["step-1", "step", "1"]), lines
        out = tmp_path / f"hf-{pointer}"
        merged = cli("ckpt", "consolidate", path, str(out))
        assert merged.returncode == 0, merged
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert index["metadata"]["step"] == step



def test_ckpt_commands_but_consolidate_do_not_import_torch():
    from distrun.testing import imports_torch

    assert not imports_torch("distrun_safetensors.plugin", "distrun_safetensors.cli",
                             "distrun_safetensors.validation", "distrun_safetensors.leftovers")
