"""What an --ft run listens on, on one host: loopback only. torchft binds its ManagerServer on
``[::]`` and its rendezvous store on every interface by itself; distrun-ft puts both on the
run's address (distrun_ft.binding)."""

from __future__ import annotations

import pytest

from distrun.testing.sockets import exposed


@pytest.mark.slow
def test_nothing_listens_beyond_loopback(launch, ft, tmp_path):
    run = launch("--ft", "--replica-groups", "2", "--nproc-per-node", "2", "--strategy", "ddp",
                 "--batch-size", "16", "--max-epochs", "99", "--timeout", "60",
                 "--ft-heartbeat", "1", "ft_task:Task",
                 env=ft.env(tmp_path, FT_STEP_SLEEP="0.2"))
    rows = [tmp_path / f"replica{g}-rank{r}.jsonl" for g in (0, 1) for r in (0, 1)]
    ft.wait_for(rows, run, timeout=180)  # every rank has committed a step: all servers up
    every, outside = exposed(run.proc.pid)
    workers = {int((tmp_path / f"pid-replica{g}-rank{r}-attempt0").read_text())
               for g in (0, 1) for r in (0, 1)}
    # the workers listen (distrun's store, torchft's ManagerServer and rendezvous stores,
    # gloo), all of it on loopback
    assert workers <= {s.pid for s in every}, every
    assert not outside, outside
