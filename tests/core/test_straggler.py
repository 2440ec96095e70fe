"""The slow rank is named, once, with its slow phase; an even run names nobody; metrics.csv
carries the spread of the ranks' compute time.

The judging rule (:mod:`distrun._diagnose.straggler`) is fed windows of times here as the
step boundary's reduction would bring them; one real 2-rank run has a rank 30 ms slower in
its training_step at every step."""

from __future__ import annotations

import csv
import os
import random
import re
from pathlib import Path

from distrun._diagnose.straggler import SLOTS, SUSTAINED, WINDOW_STEPS, Stragglers
from distrun.testing import run_cli

HERE = Path(__file__).resolve().parent


def _feed(judge: Stragglers, per_rank: list[tuple[float, float, float]], steps: int,
          every: int = 10) -> list[str]:
    """``steps`` steps in reductions of ``every``; each rank's (data, forward, optimizer)
    seconds a step; what the judge said."""
    said = []
    for _ in range(steps // every):
        values = []
        for times in per_rank:
            values.extend([*times, 0.0])
        assert len(values) == SLOTS * len(per_rank)
        line = judge.add(values, every)
        if line:
            said.append(line)
    return said


def test_a_rank_slower_for_a_sustained_window_is_named_once_with_its_phase():
    judge = Stragglers(4, host="h0")
    even = (0.002, 0.010, 0.001)
    slow = (0.002, 0.014, 0.001)  # 4 ms more forward: 31% more compute
    said = _feed(judge, [even, even, even, slow], WINDOW_STEPS * (SUSTAINED + 3))
    assert said == ["rank 3 (host h0) computes 31% longer than the others for "
                    f"{WINDOW_STEPS * SUSTAINED} steps: forward 14.0 ms vs 10.0 ms a step (the "
                    "whole run waits for it)"], said
    spread = judge.spread
    assert spread is not None and spread.slowest_rank == 3
    assert abs(spread.slowest - 0.017) < 1e-9 and abs(spread.fastest - 0.013) < 1e-9


def test_an_even_run_with_noise_and_a_short_slow_spell_names_nobody():
    rng = random.Random(0)
    judge = Stragglers(2)
    said = []
    for window in range(40):
        spell = window == 7  # one window of one rank 50% slower: not sustained
        for _ in range(WINDOW_STEPS // 10):
            times = [(0.001 * rng.uniform(0.85, 1.15), 0.004 * rng.uniform(0.85, 1.15), 0.0005)
                     for _ in range(2)]
            if spell:
                times[1] = (0.001, 0.007, 0.0005)
            line = judge.add([v for t in times for v in (*t, 0.0)], 10)
            if line:
                said.append(line)
    assert said == []


def test_a_small_excess_on_a_tiny_step_is_noise_not_a_straggler():
    judge = Stragglers(2)
    fast, slow = (0.0001, 0.0003, 0.0001), (0.0001, 0.0006, 0.0001)  # 60% more, 0.3 ms
    assert _feed(judge, [fast, slow], WINDOW_STEPS * 5) == []


def test_a_real_rank_30_ms_slower_per_step_is_named_and_the_spread_logged(tmp_path):
    result = run_cli("run", "--nproc-per-node", "2", "--name", "s", "--batch-size", "16",
                     "--max-epochs", "2", "stall_task:StallTask", cwd=tmp_path, timeout=300,
                     env={"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get(
                         "PYTHONPATH", "")]), "SLOW_MS": "30"})
    assert result.returncode == 0, result
    named = [ln for ln in (result.stdout + result.stderr).splitlines() if "computes" in ln]
    assert len(named) == 1, named
    assert re.fullmatch(r"warning: rank 1 \(host \S+\) computes \d+(\.\d)?x as long as the "
                        r"others for 200 steps: forward 3\d\.\d ms vs \d+\.\d ms a step \(the "
                        r"whole run waits for it\)", named[0]), named
    with open(tmp_path / "runs" / "s" / "metrics.csv") as fh:
        rows = [r for r in csv.DictReader(fh) if r["slowest_rank"]]
    assert rows, "no row with the spread"
    last = rows[-1]
    assert last["slowest_rank"] == "1", last
    assert float(last["slowest_compute_ms"]) >= 30.0 > float(last["fastest_compute_ms"]), last
