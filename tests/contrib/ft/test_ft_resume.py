"""Every --ft group lost at once: the replacements go on from the run's newest checkpoint, and
a group that trains on alone keeps saving while another one restarts (no fencing between the
groups of one run)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("distrun_safetensors")

BATCH = 16


def _args(run_dir: Path, steps: int, *extra: str) -> list[str]:
    return ["--ft", "--replica-groups", "2", "--nproc-per-node", "1", "--strategy", "ddp",
            "--batch-size", str(BATCH), "--max-epochs", "99", "--max-steps", str(steps),
            "--timeout", "60", "--ft-heartbeat", "1", "--seed", "3", "--run-dir", str(run_dir),
            "--ckpt-every-n-steps", "5", "--ckpt-keep-last", "0", *extra, "ft_task:Task"]


def _committed(ckpt: Path) -> dict[int, str]:
    """step -> the manifest of each committed checkpoint (its text: any rewrite changes it)."""
    out = {}
    for manifest in ckpt.glob("step-*/manifest.json"):
        out[int(json.loads(manifest.read_text())["step"])] = manifest.read_text()
    return out


def _pid(record: Path, replica: int, attempt: int) -> int:
    return int((record / f"pid-replica{replica}-rank0-attempt{attempt}").read_text())


@pytest.mark.slow
def test_every_group_killed_resumes_from_the_newest_checkpoint(launch, ft, tmp_path):
    run_dir, steps = tmp_path / "run", 40
    ckpt = run_dir / "checkpoints"
    run = launch(*_args(run_dir, steps), env=ft.env(tmp_path, FT_STEP_SLEEP="0.3"))
    ft.wait_for([ckpt / "step-10" / "manifest.json"], run, timeout=240)
    os.kill(_pid(tmp_path, 1, 0), signal.SIGKILL)
    time.sleep(2)
    os.kill(_pid(tmp_path, 0, 0), signal.SIGKILL)
    time.sleep(0.5)  # (the kernel has reaped nothing of theirs that could still commit)
    before = _committed(ckpt)
    newest = max(before)
    assert newest >= 10, before
    assert run.wait(timeout=300) == 0, run.output()[-4000:]
    out = run.output()
    assert "replica group 0 lost" in out and "replica group 1 lost" in out, out[-4000:]
    assert "Resumed from" in out, out[-4000:]
    rows = ft.rows(tmp_path)
    second = {g: sorted(r["step"] for r in rows if r["replica"] == g and r["attempt"] == 1)
              for g in (0, 1)}
    # neither replacement trained again from step 1 or any committed step: the first went on
    # from the newest checkpoint, the other from it too or healed from the first later on
    assert all(s and s[0] > newest and s[-1] == steps for s in second.values()), second
    assert sorted(set(second[0]) | set(second[1])) == list(range(newest + 1, steps + 1))
    assert all(len(s) == len(set(s)) for s in second.values()), "a step trained twice"
    trained = {r["step"] for r in rows}
    assert trained == set(range(1, steps + 1)), "a step never trained"
    after = _committed(ckpt)
    for step, manifest in before.items():  # the first life's checkpoints, untouched
        assert after.get(step) == manifest, f"step-{step} was rewritten or lost"
    assert max(after) == steps
    csv = (run_dir / "replica0" / "metrics.csv").read_text().splitlines()
    logged = [int(line.split(",")[0]) for line in csv[1:] if line.split(",")[0].isdigit()]
    assert logged and logged[-1] == steps
    assert run.descendants and not [p for p in run.descendants if ft.alive(p)]


@pytest.mark.slow
def test_the_last_live_group_keeps_saving_while_the_other_restarts(launch, ft, tmp_path):
    # Group 0 (the saver) killed three times, each time once its replacement has healed and
    # committed a checkpoint: group 1 saves alone meanwhile and must never be fenced for it.
    run_dir, steps = tmp_path / "run", 300
    ckpt = run_dir / "checkpoints"
    release = tmp_path / "release"
    run = launch(*_args(run_dir, steps), env=ft.env(tmp_path, FT_STEP_SLEEP="0.25",
                                                    FT_SLOW_UNTIL=str(release)))
    for attempt in range(3):
        deadline = time.monotonic() + 240
        while True:  # this life of group 0 trained a step, and a checkpoint after it exists
            mine = [r["step"] for r in ft.rows(tmp_path)
                    if r["replica"] == 0 and r["attempt"] == attempt]
            if mine and max(_committed(ckpt), default=0) >= min(mine):
                break
            assert run.proc.poll() is None and time.monotonic() < deadline, \
                run.output()[-4000:]
            time.sleep(0.1)
        os.kill(_pid(tmp_path, 0, attempt), signal.SIGKILL)
    ft.wait_for([tmp_path / "pid-replica0-rank0-attempt3"], run, timeout=240)
    release.touch()
    assert run.wait(timeout=400) == 0, run.output()[-4000:]
    out = run.output()
    assert "fenced" not in out and "replica group 1 lost" not in out, out[-4000:]
    group1 = sorted(r["step"] for r in ft.rows(tmp_path) if r["replica"] == 1)
    assert group1 == list(range(1, steps + 1)), "group 1 lost or repeated steps"
    assert max(_committed(ckpt)) == steps
    assert run.descendants and not [p for p in run.descendants if ft.alive(p)]
