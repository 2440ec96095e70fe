"""kill -9 of a replica group under --ft: the others keep training, nothing is lost or repeated.

Groups of 2 ranks with an inner ddp; the kill lands while the surviving group waits inside the
cross-group gradient all-reduce (held there by ft_task's hook, not by timing).
"""

from __future__ import annotations

import importlib.util
import os
import signal
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

SAMPLES, BATCH = 96, 16
PER_EPOCH = SAMPLES // BATCH


def _args(steps: int, groups: int = 2, *extra: str) -> list[str]:
    return ["--ft", "--replica-groups", str(groups), "--nproc-per-node", "2",
            "--strategy", "ddp", "--batch-size", str(BATCH), "--max-epochs", "99",
            "--max-steps", str(steps), "--timeout", "60", "--ft-heartbeat", "1", "--seed", "3",
            "--log-every-n-steps", "1", *extra, "ft_task:Task"]


def _check_exactly_once(rows: list[dict], steps: int) -> dict[int, list[dict]]:
    by_step: dict[int, list[dict]] = defaultdict(list)
    for row in rows:
        by_step[row["step"]].append(row)
    assert sorted(by_step) == list(range(1, steps + 1))
    for step, group in by_step.items():
        ranks = [(r["replica"], r["rank"]) for r in group]
        assert len(ranks) == len(set(ranks)), f"step {step} committed twice by one rank"
        assert {r["participants"] for r in group} == {len({r["replica"] for r in group})}
    for epoch in range(steps // PER_EPOCH):
        ids = [i for s in range(epoch * PER_EPOCH + 1, (epoch + 1) * PER_EPOCH + 1)
               for r in by_step[s] for i in r["ids"]]
        assert sorted(ids) == list(range(SAMPLES)), f"epoch {epoch}: not each sample once"
    return by_step


def _check_bit_equal(record: Path, expected: int) -> None:
    weights = [load_file(p) for p in sorted(record.glob("weights-*.safetensors"))]
    assert len(weights) == expected
    for other in weights[1:]:
        assert other.keys() == weights[0].keys()
        for key in weights[0]:
            assert torch.equal(other[key], weights[0][key]), key


def test_kill_a_group_held_in_the_allreduce(launch, ft, tmp_path):
    steps, hold = 4 * PER_EPOCH, 5
    run = launch(*_args(steps), env=ft.env(tmp_path, FT_HOLD_STEP=str(hold),
                                           FT_HOLD_VICTIM="1", FT_AWAIT_REPLACEMENT="1"))
    held = [tmp_path / "victim-held-rank0", tmp_path / "victim-held-rank1",
            tmp_path / "peer0-at-allreduce"]
    ft.wait_for(held, run, timeout=180)
    victims = [int((tmp_path / f"victim-held-rank{r}").read_text()) for r in (0, 1)]
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    code = run.wait(timeout=300)
    out = run.output()
    assert code == 0, out[-4000:]
    assert "replica group 1 lost (rank" in out and "restarting it (restart 1 of 3)" in out

    by_step = _check_exactly_once(ft.rows(tmp_path), steps)
    survivor = [r for r in ft.rows(tmp_path) if r["replica"] == 0 and r["rank"] == 0]
    assert [r["step"] for r in survivor] == list(range(1, steps + 1))  # none lost, none twice
    assert survivor[hold - 1]["participants"] == 1  # the held step went on without the victim
    assert all(r["replica"] == 0 for r in by_step[hold])
    first = [r for r in ft.rows(tmp_path) if r["replica"] == 1 and r["attempt"] == 0]
    assert max(r["step"] for r in first) == hold - 1
    back = [r for r in ft.rows(tmp_path) if r["replica"] == 1 and r["attempt"] == 1]
    assert back, "the replacement never rejoined"
    assert all(r["participants"] == 2 for r in back) and back[-1]["step"] == steps
    # healed from the survivor: weights bit-equal to its peers' at the end
    _check_bit_equal(tmp_path, expected=4)
    csv = next(tmp_path.glob("runs/*/replica0/metrics.csv")).read_text().splitlines()
    assert csv[0].split(",")[3:] == ["loss", "ft_participants", "ft_quorum_id",
                                     "ft_replica_rank"]
    assert len(csv) == steps + 1
    # every process the launcher started is gone (workers of both lives, the lighthouse)
    assert run.descendants and not [p for p in run.descendants if ft.alive(p)]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("distrun_fsdp") is None,
                    reason="needs the fsdp strategy: pip install distrun-fsdp")
def test_inner_fsdp_group_killed_and_healed(launch, ft, tmp_path):
    # The HSDP shape: fsdp shards the model over the 2 ranks of a group, torchft averages
    # each shard's gradient with the same shard of the other group.
    steps, hold = 3 * PER_EPOCH, 4
    args = _args(steps)
    args[args.index("ddp")] = "fsdp"
    run = launch(*args, env=ft.env(tmp_path, FT_HOLD_STEP=str(hold), FT_HOLD_VICTIM="1",
                                   FT_AWAIT_REPLACEMENT="1"))
    ft.wait_for([tmp_path / "victim-held-rank0", tmp_path / "victim-held-rank1",
                 tmp_path / "peer0-at-allreduce"], run, timeout=180)
    for r in (0, 1):
        os.kill(int((tmp_path / f"victim-held-rank{r}").read_text()), signal.SIGKILL)
    assert run.wait(timeout=300) == 0, run.output()[-4000:]
    _check_exactly_once(ft.rows(tmp_path), steps)
    back = [r for r in ft.rows(tmp_path) if r["replica"] == 1 and r["attempt"] == 1]
    assert back and all(r["participants"] == 2 for r in back) and back[-1]["step"] == steps
    for rank in (0, 1):  # each rank's shards, bit-equal to the same rank's of the other group
        shards = [load_file(tmp_path / f"weights-replica{g}-rank{rank}.safetensors")
                  for g in (0, 1)]
        assert shards[0].keys() == shards[1].keys()
        assert all(torch.equal(shards[0][k], shards[1][k]) for k in shards[0])
    assert run.descendants and not [p for p in run.descendants if ft.alive(p)]
