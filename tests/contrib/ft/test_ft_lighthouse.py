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


#: a participant of an older torchft: it joins the quorum through torchft's own
#: LighthouseClient, which sends no process-group handle (as torchft==0.2.0's clients, and
#: 0.2.0's lighthouse for every participant, do); it heartbeats and asks again until killed
FOREIGN = """
import sys
from datetime import timedelta
from torchft._torchft import LighthouseClient

client = LighthouseClient(sys.argv[1], connect_timeout=timedelta(seconds=10))
while True:
    client.heartbeat("foreign")
    try:
        client.quorum(replica_id="foreign", timeout=timedelta(seconds=1),
                      address="http://127.0.0.1:9", store_address="127.0.0.1:9", step=0,
                      world_size=1, shrink_only=False)
    except Exception:
        pass
"""


@pytest.mark.slow
def test_a_quorum_of_another_torchft_is_one_line(ft, tmp_path):
    import subprocess
    import sys

    from distrun.plugin import die_with_parent
    from distrun.testing import run_cli

    lighthouse = subprocess.Popen(  # a quorum needs 2: the run's group and the foreign one
        [sys.executable, "-m", "distrun_ft.lighthouse", "127.0.0.1:0", "2", "1000", "1000"],
        stdout=subprocess.PIPE, text=True, preexec_fn=die_with_parent())
    foreign = None
    try:
        address = lighthouse.stdout.readline().strip()
        foreign = subprocess.Popen([sys.executable, "-c", FOREIGN, address],
                                   preexec_fn=die_with_parent())
        r = run_cli("run", "--ft", "--replica-groups", "1", "--nproc-per-node", "2",
                    "--strategy", "ddp", "--batch-size", "16", "--max-steps", "6",
                    "--timeout", "60", "--ft-heartbeat", "1", "--ft-lighthouse", address,
                    "ft_task:Task", cwd=tmp_path, env=ft.env(tmp_path), timeout=240)
        assert r.returncode == 2, r
        said = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert len(said) == 1 and "Traceback" not in r.output, r
        assert said[0].startswith(f"error: the torchft lighthouse at {address} (or a replica "
                                  "group on another host) runs another torchft than this one "
                                  "(torchft-nightly==2026.10.26): 1 of the 2 participants"), r
        assert "restarting" not in r.output, r  # a usage error: no restart of the group
        assert not list(tmp_path.glob("replica*-rank*.jsonl"))  # no step committed
    finally:
        for proc in (foreign, lighthouse):
            if proc is not None:
                proc.kill()
                proc.wait()
        lighthouse.stdout.close()
