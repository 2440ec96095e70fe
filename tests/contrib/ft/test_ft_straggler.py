"""The slow rank under --ft: the ft loop runs its own steps, so it carries the ranks' compute
times in reductions it runs anyway (run.compute_times): this rank against its counterparts in
the other replica groups in the gradients' all-reduce across them, and a group's ranks in its
log reduction. One group that computes 30 ms a step longer is named once, by the lowest live
group, and each group's metrics.csv gains the spread."""

from __future__ import annotations

import csv
import re

import pytest

STEPS = 240  # two windows of 100 steps in a row, and a few to log the last one


def _rows(tmp_path, group: int) -> list[dict[str, str]]:
    with open(tmp_path / "runs" / "slow" / f"replica{group}" / "metrics.csv") as fh:
        return list(csv.DictReader(fh))


@pytest.mark.parametrize("sync", [pytest.param("", id="every-step"),
                                  pytest.param("localsgd:4", marks=pytest.mark.slow)])
def test_a_replica_group_30_ms_slower_a_step_is_named_once(launch, ft, tmp_path, sync):
    # (every step the groups' times ride in the gradients' all-reduce; under --ft-sync in
    # each window's sync)
    run = launch("--ft", "--replica-groups", "2", "--nproc-per-node", "1", "--batch-size", "8",
                 "--max-epochs", "99", "--max-steps", str(STEPS), "--timeout", "60",
                 "--seed", "3", "--name", "slow", "--log-every-n-steps", "20",
                 *(["--ft-sync", sync] if sync else []), "ft_task:Task", env=ft.env(tmp_path, FT_SLOW_MS="30", FT_SLOW_REPLICA="1"))
    code = run.wait(timeout=400)
    out = run.output()
    assert code == 0, out[-4000:]
    named = [ln for ln in out.splitlines() if " computes " in ln]
    assert len(named) == 1, out[-4000:]
    assert re.search(r"warning: replica group 1 computes \d+(\.\d)?x as long as the others for "
                     r"200 steps: forward \d+\.\d ms vs \d+\.\d ms a step", named[0]), named
    for group in (0, 1):  # each group's rows: the same spread, group 1 the slowest
        last = [r for r in _rows(tmp_path, group) if r.get("slowest_group")][-1]
        assert last["slowest_group"] == "1", last
        assert float(last["slowest_group_compute_ms"]) >= 30.0 > \
            float(last["fastest_group_compute_ms"]), last
        assert "slowest_rank" not in last or not last["slowest_rank"], last  # one rank each


@pytest.mark.slow
def test_a_slow_rank_in_a_group_is_named_by_its_group_and_against_the_other_group(
        launch, ft, tmp_path):
    run = launch("--ft", "--replica-groups", "2", "--nproc-per-node", "2", "--strategy", "ddp",
                 "--batch-size", "8", "--max-epochs", "99", "--max-steps", str(STEPS),
                 "--timeout", "60", "--seed", "3", "--name", "slow", "--log-every-n-steps",
                 "20", "ft_task:Task",
                 env=ft.env(tmp_path, FT_SLOW_MS="30", FT_SLOW_REPLICA="0", FT_SLOW_RANK="1"))
    code = run.wait(timeout=400)
    out = run.output()
    assert code == 0, out[-4000:]
    named = sorted(ln for ln in out.splitlines() if " computes " in ln)
    assert len(named) == 2, out[-4000:]
    # its group's ranks compared (in the group's log reduction) ...
    assert re.search(r"warning: replica group 0: rank 1 \(host \S+\) computes \d+(\.\d)?x as "
                     r"long as the others for 200 steps: forward", named[1]), named
    # ... and it against rank 1 of the other group (in the all-reduce across the groups)
    assert re.search(r"warning: replica group 0 \(its rank 1\) computes \d+(\.\d)?x as long as "
                     r"the others for 200 steps: forward", named[0]), named
    last = [r for r in _rows(tmp_path, 0) if r.get("slowest_rank")][-1]
    assert last["slowest_rank"] == "1" and float(last["slowest_compute_ms"]) >= 30.0, last
