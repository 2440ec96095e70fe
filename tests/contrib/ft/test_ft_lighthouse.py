"""The lighthouse is the run's single point of failure: its loss is one line and a retryable
exit, and nothing of the run is left behind."""

from __future__ import annotations

import os
import signal

import pytest


@pytest.mark.slow
def test_lighthouse_loss_exits_for_requeue(launch, ft, tmp_path):
    run = launch("--ft", "--replica-groups", "2", "--nproc-per-node", "1", "--strategy", "ddp",
                 "--batch-size", "16", "--max-epochs", "99", "--timeout", "60",
                 "--ft-heartbeat", "1", "ft_task:Task",
                 env=ft.env(tmp_path, FT_STEP_SLEEP="0.05"))
    ft.wait_for([tmp_path / "replica0-rank0.jsonl", tmp_path / "replica1-rank0.jsonl"], run,
                timeout=180)
    run.watch()
    lighthouses = [p for p in run.descendants if _cmdline(p).count("distrun_ft.lighthouse")]
    assert len(lighthouses) == 1
    os.kill(lighthouses[0], signal.SIGKILL)
    code = run.wait(timeout=120)
    out = run.output()
    assert code == 143, out[-3000:]
    said = [line for line in out.splitlines() if "torchft lighthouse" in line]
    assert said == [f"distrun: the torchft lighthouse (pid {lighthouses[0]}) exited with code -9: "
                    "no replica group can form a quorum without it; stopping every group; run "
                    "again with --resume auto to go on from the newest checkpoint (exit 143, "
                    "requeue)"]
    assert not [p for p in run.descendants if ft.alive(p)]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.slow
def test_a_running_lighthouse_is_used(launch, ft, tmp_path):
    import subprocess
    import sys

    from distrun.plugin import die_with_parent

    lighthouse = subprocess.Popen(
        [sys.executable, "-m", "distrun_ft.lighthouse", "127.0.0.1:0", "1", "1000", "1000"],
        stdout=subprocess.PIPE, text=True, preexec_fn=die_with_parent())
    try:
        address = lighthouse.stdout.readline().strip()
        run = launch("--ft", "--replica-groups", "2", "--nproc-per-node", "1", "--strategy",
                     "ddp", "--batch-size", "16", "--max-steps", "6", "--timeout", "60",
                     "--ft-heartbeat", "1", "--ft-lighthouse", address, "ft_task:Task")
        assert run.wait(timeout=180) == 0, run.output()[-3000:]
        rows = ft.rows(tmp_path)
        assert sorted(r["step"] for r in rows) == sorted(list(range(1, 7)) * 2)
        assert {r["participants"] for r in rows} == {2}
        assert not [p for p in run.descendants if "distrun_ft.lighthouse" in _cmdline(p)]
        assert lighthouse.poll() is None  # not the launcher's to stop
    finally:
        lighthouse.terminate()
        lighthouse.wait()
        lighthouse.stdout.close()
