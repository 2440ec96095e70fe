"""What an --ft run listens on: distrun's own servers on loopback; torchft's two servers that
it binds on every interface (documented in docs/cluster.md), and nothing else."""

from __future__ import annotations

import pytest

from distrun.testing.sockets import exposed


@pytest.mark.slow
def test_only_torchfts_own_servers_listen_beyond_loopback(launch, ft, tmp_path):
    run = launch("--ft", "--replica-groups", "2", "--nproc-per-node", "2", "--strategy", "ddp",
                 "--batch-size", "16", "--max-epochs", "99", "--timeout", "60",
                 "--ft-heartbeat", "1", "ft_task:Task",
                 env=ft.env(tmp_path, FT_STEP_SLEEP="0.2"))
    rows = [tmp_path / f"replica{g}-rank{r}.jsonl" for g in (0, 1) for r in (0, 1)]
    ft.wait_for(rows, run, timeout=180)  # every rank has committed a step: all servers up
    every, outside = exposed(run.proc.pid)
    workers = {int((tmp_path / f"pid-replica{g}-rank{r}-attempt0").read_text()): r
               for g in (0, 1) for r in (0, 1)}
    assert every and all(s.pid in workers for s in outside), outside  # launcher, lighthouse: no
    per_worker = {pid: sum(1 for s in outside if s.pid == pid) for pid in workers}
    # rank 0 of a group: torchft's ManagerServer ([::]) and its process group's rendezvous
    # store (a TCPStore on every interface); other ranks: that store only
    assert per_worker == {pid: 2 if rank == 0 else 1 for pid, rank in workers.items()}, outside
