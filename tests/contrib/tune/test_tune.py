"""distrun-tune: the LR range test and the batch-size finder against answers known in advance,
on 2 gloo ranks under DDP through `distrun tune`, and on one process through a Trainer."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import pytest

from distrun.testing import run_cli

HERE = Path(__file__).resolve().parent
TASKS = HERE / "tune_tasks.py"
sys.path.insert(0, str(HERE))  # tune_tasks, for the in-process Trainer test
from tune_tasks import MIB, ManualQuadratic, Quadratic  # noqa: E402

needs_ddp = pytest.mark.skipif(importlib.util.find_spec("distrun_ddp") is None,
                               reason="two ranks need the ddp strategy (distrun-ddp)")
L = 10.0  # the quadratic's largest curvature: SGD diverges above 2/L = 0.2
PNG = b"\x89PNG\r\n\x1a\n"


def _env(**values: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **values}


@needs_ddp
@pytest.mark.slow
def test_lr_range_test_on_a_quadratic_on_two_ranks(tmp_path):
    result = run_cli("tune", "lr", "--nproc-per-node", "2", "--strategy", "ddp",
                     "--batch-size", "8", "--tune-min-lr", "1e-4", "--tune-max-lr", "10",
                     "--tune-steps", "60", "--name", "q", "--no-progress",
                     f"{TASKS}:Quadratic", cwd=tmp_path, env=_env(QUAD_L=str(L)))
    assert result.returncode == 0, result
    out = json.loads((tmp_path / "runs/q/tune/lr_find.json").read_text())
    assert out["world_size"] == 2 and out["strategy"] == "ddp"
    lr = out["suggestion"]
    # Below the divergence bound, within a factor 4 of the fastest rate 1/L.
    assert lr < 2 / L, out["suggestion"]
    assert 1 / (4 * L) <= lr <= 4 / L, out["suggestion"]
    # The test ran until the loss diverged, and that happened only above 2/L.
    assert out["stopped"].startswith("the loss diverged at lr"), out["stopped"]
    assert out["lr"][-1] > 2 / L and len(out["lr"]) < 60
    assert all(math.isfinite(v) for v in out["loss"][:-1])
    assert (tmp_path / "runs/q/tune/lr_find.png").read_bytes()[:8] == PNG
    assert f"LR range test (ddp, 2 ranks): suggested lr {lr:.3g}" in result.stdout, result
    assert "runs/q/tune/lr_find.png" in result.stdout


def test_trainer_tune_lr_leaves_the_model_as_it_was(tmp_path, monkeypatch):
    import torch

    import distrun
    import distrun_tune.plugin

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("QUAD_L", str(L))
    task = Quadratic()
    trainer = distrun.Trainer(plugins=(distrun_tune.plugin,), tune="lr", batch_size=8,
                              tune_min_lr=1e-4, tune_max_lr=10.0, tune_steps=60,
                              run_dir=str(tmp_path / "run"), progress=False)
    with trainer:
        run = trainer.fit(task)
        found = run.results["tune"]["suggestion"]
        weight = run.unwrapped_model().weight.detach().clone()
        lrs = [g["lr"] for g in run.optimizer.param_groups]
        state = run.optimizer.state_dict()["state"]
    assert found is not None and found < 2 / L
    assert torch.equal(weight, torch.zeros_like(weight))  # as configure_model() made it
    assert lrs == [0.01]  # the optimizer's own rate is back
    assert not state  # plain SGD keeps none: nothing of the finder's steps is left
    assert (tmp_path / "run/tune/lr_find.png").read_bytes()[:8] == PNG


@needs_ddp
@pytest.mark.slow
def test_batch_size_finder_on_two_ranks_under_a_memory_budget(tmp_path):
    # Each step holds 32 MiB per sample on rank 0 and 64 MiB on rank 1, so rank 1 decides:
    # with baseline B_r (the finder's own reading before its trials) the answer is
    # min_r floor((budget - B_r) / per_sample_r), give or take one sample of allocator slack.
    budget = 1024 * MIB
    result = run_cli("tune", "batch-size", "--nproc-per-node", "2", "--strategy", "ddp",
                     "--tune-max-memory", "1GiB", "--name", "b", "--no-progress",
                     f"{TASKS}:MemoryHog", cwd=tmp_path, env=_env(MEM_MIB="32", MEM_BY_RANK="1"))
    assert result.returncode == 0, result
    out = json.loads((tmp_path / "runs/b/tune/batch_size.json").read_text())
    assert out["budget"] == budget and out["world_size"] == 2 and out["dp_world_size"] == 2
    per_sample = [32 * MIB, 64 * MIB]
    expected = min(int((budget - base) // size) for base, size in zip(out["baseline"], per_sample))
    assert expected >= 3, out["baseline"]  # the budget leaves room for a search
    found = out["per_rank"]
    assert found in (expected - 1, expected), (found, expected, out)
    assert out["global"] == 2 * found and not out["capped"]
    # Doubling from 1 until the first batch that does not fit, then a binary search that ends
    # on the answer and the next batch: every trial agrees with the answer.
    sizes = [t["batch"] for t in out["trials"]]
    first_fail = next(i for i, t in enumerate(out["trials"]) if not t["fits"])
    assert sizes[:first_fail + 1] == [1 << i for i in range(first_fail + 1)], sizes
    assert all(t["fits"] == (t["batch"] <= found) for t in out["trials"]), out["trials"]
    assert {found, found + 1} <= set(sizes), sizes
    # A trial that does not fit went over the budget on rank 1, the one with larger samples.
    assert all(t["peaks"][1] > budget for t in out["trials"] if not t["fits"]), out["trials"]
    assert (tmp_path / "runs/b/tune/batch_size.png").read_bytes()[:8] == PNG
    assert f"{found} per rank fits in 1.00 GiB" in result.stdout, result
    assert f"--batch-size {2 * found} " in result.stdout, result


def test_batch_size_finder_on_cpu_needs_a_budget(tmp_path):
    result = run_cli("tune", "batch-size", "--no-progress", f"{TASKS}:MemoryHog", cwd=tmp_path,
                     env=_env(MEM_MIB="1"))
    assert result.returncode == 2, result
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]
    assert errors == ["error: --tune batch-size on CPU needs --tune-max-memory (e.g. "
                      "--tune-max-memory 4GiB): a CPU has no out-of-memory error, so a rank's peak RSS under "
                      "that budget is what fits"], result
    assert "Traceback" not in result.stderr


def test_a_budget_that_is_not_a_size_is_one_line(tmp_path):
    result = run_cli("tune", "batch-size", "--tune-max-memory", "lots", f"{TASKS}:MemoryHog",
                     cwd=tmp_path)
    assert result.returncode == 2, result
    assert "error: --tune-max-memory 'lots' is not a size (write e.g. 4GiB, 512MiB or 2GB)" \
        in result.stderr, result
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_the_finders_refuse_manual_optimization_in_one_line(distrun_pm, tmp_path, capsys):
    import distrun
    import distrun_tune.plugin

    with pytest.raises(SystemExit) as exited:
        distrun.Trainer(plugins=(distrun_tune.plugin,), tune="lr", batch_size=8,
                        summary=False, run_dir=str(tmp_path / "run")).fit(ManualQuadratic())
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert [ln for ln in err.splitlines() if ln.startswith("error: ")] == [
        "error: --tune lr: the finder takes the fit's steps (one optimizer, stepped by the "
        "loop), but ManualQuadratic steps its optimizers itself (automatic_optimization = "
        "False); tune a version of the task with automatic optimization and one optimizer, "
        "or drop --tune"], err
    assert "Traceback" not in err
    assert not (tmp_path / "run" / "tune").exists()  # no finder step ran


def test_tune_lists_its_finders(cli):
    result = cli("tune", "--help")
    assert result.returncode == 0, result
    assert "lr" in result.stdout and "batch-size" in result.stdout
