"""Durable checkpoints under --ft: the lowest live replica writes them on the checkpoint
plugin's cadence, and the loss of every group resumes from disk."""

from __future__ import annotations

import json
import os
import signal
from collections import defaultdict

import pytest

pytest.importorskip("distrun_safetensors")

SAMPLES, BATCH = 96, 16
PER_EPOCH = SAMPLES // BATCH


def _args(run_dir, steps: int, *extra: str) -> list[str]:
    return ["--ft", "--replica-groups", "2", "--nproc-per-node", "2", "--strategy", "ddp",
            "--batch-size", str(BATCH), "--max-epochs", "99", "--max-steps", str(steps),
            "--timeout", "60", "--ft-heartbeat", "1", "--seed", "3", "--run-dir", str(run_dir),
            "--ckpt-every-n-steps", "4", "--ckpt-keep-last", "0", *extra, "ft_task:Task"]


def _saved_steps(ckpt_dir) -> list[int]:
    steps = []
    for manifest in ckpt_dir.glob("*/manifest.json"):
        steps.append(int(json.loads(manifest.read_text())["step"]))
    return sorted(steps)


@pytest.mark.slow
def test_lowest_live_replica_saves_and_a_lost_run_resumes(launch, ft, tmp_path):
    run_dir = tmp_path / "run"
    # Group 0 (the lowest replica, the one that saves) dies at step 10 and is not restarted:
    # group 1 is then the lowest live replica and saves steps 12 to 24 alone.
    first = launch(*_args(run_dir, 24, "--ft-max-restarts", "0"),
                   env=ft.env(tmp_path, FT_HOLD_STEP="10", FT_HOLD_VICTIM="0"))
    ft.wait_for([tmp_path / "victim-held-rank0", tmp_path / "victim-held-rank1"], first, 180)
    for r in (0, 1):
        os.kill(int((tmp_path / f"victim-held-rank{r}").read_text()), signal.SIGKILL)
    assert first.wait(timeout=300) == 0, first.output()[-4000:]
    assert "replica group 0 lost" in first.output()
    ckpt = run_dir / "checkpoints"
    assert _saved_steps(ckpt) == [4, 8, 12, 16, 20, 24]
    assert not list(tmp_path.glob("run/replica*/checkpoints")), "a group saved elsewhere"

    # every group lost at once: a new launch resumes both groups from the newest checkpoint
    for path in tmp_path.glob("replica*-rank*.jsonl"):
        path.unlink()
    for path in tmp_path.glob("weights-*.safetensors"):
        path.unlink()
    second = launch(*_args(run_dir, 36, "--resume", "auto"), env=ft.env(tmp_path))
    assert second.wait(timeout=300) == 0, second.output()[-4000:]
    rows = ft.rows(tmp_path)
    by_step = defaultdict(list)
    for row in rows:
        by_step[row["step"]].append(row)
    assert sorted(by_step) == list(range(25, 37))  # from the checkpoint on, none replayed
    assert all(len(by_step[s]) == 4 and by_step[s][0]["participants"] == 2 for s in by_step)
    for epoch in (4, 5):
        ids = [i for s in range(epoch * PER_EPOCH + 1, (epoch + 1) * PER_EPOCH + 1)
               for r in by_step[s] for i in r["ids"]]
        assert sorted(ids) == list(range(SAMPLES))
    import torch
    from safetensors.torch import load_file

    weights = [load_file(p) for p in sorted(tmp_path.glob("weights-*.safetensors"))]
    assert len(weights) == 4
    assert all(torch.equal(w[k], weights[0][k]) for w in weights[1:] for k in weights[0])
    assert _saved_steps(ckpt)[-1] == 36


@pytest.mark.slow
def test_a_commit_survives_the_saving_group_dying_mid_save(launch, ft, tmp_path):
    from distrun.testing import run_cli

    run_dir = tmp_path / "run"
    # Group 0 (the saver) writes its files of step 8 and is killed before it commits them;
    # group 1, the lowest live replica from then on, commits steps 12 and 16.
    run = launch(*_args(run_dir, 16, "--ft-max-restarts", "0"),
                 env=ft.env(tmp_path, FT_HOLD_SAVE_STEP="8", FT_HOLD_VICTIM="0"))
    held = [tmp_path / "saver-held-rank0", tmp_path / "saver-held-rank1"]
    ft.wait_for(held, run, 180)
    ckpt = run_dir / "checkpoints"
    assert _saved_steps(ckpt) == [4]  # step 8's files are written, not committed
    for r in (0, 1):
        os.kill(int((tmp_path / f"pid-replica0-rank{r}-attempt0").read_text()), signal.SIGKILL)
    assert run.wait(timeout=300) == 0, run.output()[-4000:]
    assert "replica group 0 lost" in run.output()
    assert _saved_steps(ckpt) == [4, 12, 16]
    for step in (4, 12, 16):  # each committed one loads as a resume would read it
        folder = next(m.parent for m in ckpt.glob("*/manifest.json")
                      if json.loads(m.read_text())["step"] == step)
        verified = run_cli("ckpt", "verify", str(folder), cwd=tmp_path, timeout=120)
        assert verified.returncode == 0 and f"step {step}," in verified.stdout, verified
    rows = [r for r in ft.rows(tmp_path) if r["replica"] == 1]
    assert sorted({r["step"] for r in rows}) == list(range(1, 17))
