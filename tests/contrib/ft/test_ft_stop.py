"""SIGTERM to an --ft launcher: the groups stop within the grace period, and the run exits with
the requeue code (143), as a plain `distrun run` does."""

from __future__ import annotations

import time

import pytest

from distrun.plugin import EXIT_REQUEUE, WorkerGroup

STOP_GRACE = WorkerGroup.STOP_GRACE


def _args(run_dir, *extra: str) -> list[str]:
    return ["--ft", "--replica-groups", "2", "--nproc-per-node", "1", "--strategy", "ddp",
            "--batch-size", "16", "--max-epochs", "99", "--max-steps", "500", "--timeout", "60",
            "--ft-heartbeat", "1", "--run-dir", str(run_dir), *extra, "ft_task:Task"]


@pytest.mark.slow
def test_a_hung_run_is_killed_after_the_grace_and_requeued(launch, ft, tmp_path):
    # group 0 hangs in its first step (ft_task's hold: a loop the stop handler cannot end)
    run = launch(*_args(tmp_path / "run"),
                 env=ft.env(tmp_path, FT_HOLD_STEP="1", FT_HOLD_VICTIM="0"))
    ft.wait_for([tmp_path / "victim-held-rank0", tmp_path / "pid-replica1-rank0-attempt0"],
                run, 240)
    run.watch()
    stopped = time.monotonic()
    run.proc.terminate()
    code = run.wait(timeout=STOP_GRACE + 30)
    took = time.monotonic() - stopped
    assert code == EXIT_REQUEUE, run.output()[-4000:]
    assert took < STOP_GRACE + 10, took
    assert run.descendants and not [p for p in run.descendants if ft.alive(p)]


@pytest.mark.slow
def test_a_training_run_stops_at_once_saves_and_is_requeued(launch, ft, tmp_path):
    run_dir = tmp_path / "run"
    run = launch(*_args(run_dir, "--ckpt-every-n-steps", "1000"),
                 env=ft.env(tmp_path, FT_STEP_SLEEP="0.2"))
    ft.wait_for([tmp_path / "replica1-rank0.jsonl"], run, 240)  # both groups train
    run.watch()
    stopped = time.monotonic()
    run.proc.terminate()
    code = run.wait(timeout=STOP_GRACE + 30)
    took = time.monotonic() - stopped
    out = run.output()
    assert code == EXIT_REQUEUE, out[-4000:]
    assert took < 15, (took, out[-4000:])
    assert list((run_dir / "checkpoints").glob("step-*/manifest.json")), \
        f"no preemption checkpoint\n{out[-4000:]}"
    assert run.descendants and not [p for p in run.descendants if ft.alive(p)]
