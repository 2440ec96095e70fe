"""A hung rank under --ft: its group's stall watcher names it and ends that group; the other
group waits in torchft's quorum, is never called stalled, and trains on.

Two replica groups of 2 ranks (inner ddp), ``--timeout 30``: rank 1 of group 1 sleeps in its
training_step at step 5 (a deadlock of one rank). Its group still heartbeats, so the
lighthouse keeps it and group 0 waits for it in the quorum; only group 1's own watcher can end
that wait, and it must do so before group 0's own limits give up.
"""

from __future__ import annotations

import re
from pathlib import Path

from distrun.testing import run_cli

STEPS, HANG = 24, 5
QUORUM = 15.0  # torchft's quorum bound at --timeout 30: the watchers' default limit under --ft


def test_a_rank_hung_in_one_group_is_named_and_only_its_group_restarts(launch, ft, tmp_path):
    run = launch("--ft", "--replica-groups", "2", "--nproc-per-node", "2", "--strategy", "ddp",
                 "--batch-size", "16", "--max-epochs", "99", "--max-steps", str(STEPS),
                 "--timeout", "30", "--ft-heartbeat", "1", "--seed", "3", "--name", "hang",
                 "--log-every-n-steps", "1", "ft_task:Task",
                 env=ft.env(tmp_path, FT_HANG_STEP=str(HANG), FT_HANG_VICTIM="1"))
    ft.wait_for([tmp_path / "hung-at"], run, timeout=120)
    # meanwhile, from another terminal: a line per group, led by its name
    looked = run_cli("stacks", "runs/hang", cwd=tmp_path)  # (the user's env: no ft_task)
    code = run.wait(timeout=240)
    out = run.output()
    assert code == 0, out[-4000:]
    stalls = [ln for ln in out.splitlines() if " stall " in ln or ln.startswith("error: stall")]
    assert len(stalls) == 1, out[-4000:]
    assert re.search(rf"^error: replica group 1: stall at step {HANG}: rank 1 \(host \S+, pid \d+\) "
                     r"in training_step for \d+ s at ft_task\.py:\d+ \(time\.sleep\(600\)\); "
                     r"rank 0 in backward for \d+ s; stacks: \S+/stall-1/$", stalls[0]), stalls
    # within the limit and a few seconds of the hang; the stacks hold the sleeping line
    folder = tmp_path / "runs" / "hang" / "stall-1"
    took = (folder / "summary.txt").stat().st_mtime - float((tmp_path / "hung-at").read_text())
    assert took <= QUORUM + 5.0, took
    assert "ft_task.py" in (folder / "rank1.txt").read_text()
    assert looked.returncode == 0, looked
    lines = looked.stdout.strip().splitlines()
    assert len(lines) == 2, looked
    # (group 0 waits for group 1 in the cross-group all-reduce, then in the next quorum)
    assert re.search(r"^replica group 0: positions at step \d+: ranks 0,1 (in backward|waiting "
                     r"for the other replica groups \(quorum\)) for \d+ s; stacks: "
                     r"\S+/stacks-1/replica-group-0/$", lines[0]), lines
    assert re.search(rf"^replica group 1: positions at step {HANG}: rank 1 \(host \S+, pid \d+\) "
                     r"in training_step .*\(time\.sleep\(600\)\); rank 0 in backward", lines[1]), lines
    # group 1 alone is restarted; group 0 waited in the quorum and was never ended
    assert "replica group 1 lost" in out and "replica group 0 lost" not in out, out[-4000:]
    assert not list(Path(tmp_path).glob("pid-replica0-*-attempt1")), out[-4000:]
    assert "collective timed out" not in out, out[-4000:]
    committed = {row["step"] for row in ft.rows(tmp_path) if row["replica"] == 0}
    assert committed == set(range(1, STEPS + 1))
