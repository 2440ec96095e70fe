"""DDP on 2 gloo ranks ends with the weights of 1 process fed the same global batches.

The 2-rank runs share one pair of spawned processes (``ddp_runs``): starting torch in a fresh
process costs far more than these tiny fits. The 1-process references run in this process.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

import distrun
from distrun.testing import run_cli, run_on_ranks

sys.path.insert(0, os.path.dirname(__file__))  # ddp_tasks, importable by spawned ranks too
from ddp_tasks import Regression, fit_many, plain_weights  # noqa: E402

TOL = 1e-6
COMMON = dict(batch_size=16, max_steps=4, seed=1, timeout=120)

#: name -> options of the 2-rank runs (all in one spawn; the failing one goes last)
DDP_RUNS = {
    "accum1": dict(COMMON, strategy="ddp", count_allreduce=True),
    "accum3": dict(COMMON, strategy="ddp", grad_accum=3, count_allreduce=True),
    "options": dict(COMMON, strategy="ddp", unused=True, ddp_find_unused_parameters=True,
                    ddp_bucket_mb=0.5, ddp_gradient_as_bucket_view=False,
                    ddp_broadcast_buffers=False),
    "static": dict(COMMON, strategy="ddp", ddp_static_graph=True),
    "fp16": dict(COMMON, strategy="ddp", ddp_comm_hook="fp16"),
    # a bucket far too small for one: the plugin must raise it for PowerSGD on gloo
    "powersgd": dict(COMMON, strategy="ddp", ddp_comm_hook="powersgd", ddp_bucket_mb=0.001,
                     ddp_powersgd_rank=2, ddp_powersgd_start_iter=2),
    "unused_no_flag": dict(COMMON, strategy="ddp", unused=True, expect_error=True),
}


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory, cpu_backend):
    run_dir = str(tmp_path_factory.mktemp("ddp"))
    runs = [dict(opts, run_dir=run_dir) for opts in DDP_RUNS.values()]
    # One process group for all the runs (recreating it between fits is not what we test).
    out = run_on_ranks(fit_many, 2, runs, {}, timeout=240, init_process_group=True,
                       backend=cpu_backend)
    return [dict(zip(DDP_RUNS, per_rank, strict=True)) for per_rank in out]


def single_weights(tmp_path, **options) -> dict[str, torch.Tensor]:
    run = distrun.Trainer(strategy="single", run_dir=str(tmp_path), summary=False,
                          **{**COMMON, **options}).fit(Regression())
    return plain_weights(run)


def _assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float = TOL
                  ) -> None:
    assert list(a) == list(b)
    for name in a:
        diff = (a[name] - b[name]).abs().max().item()
        assert diff <= tol, f"{name}: max difference {diff:.3g} > {tol:g}"


def _moved(a: dict[str, torch.Tensor], seed: int) -> float:
    torch.manual_seed(seed)
    init = Regression().configure_model().state_dict()
    return max((a[k] - init[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("name,accum", [("accum1", 1), ("accum3", 3)])
def test_two_ranks_match_one_process(ddp_runs, tmp_path, name, accum):
    reference = single_weights(tmp_path, grad_accum=accum)
    for rank in (0, 1):
        result = ddp_runs[rank][name]
        assert result["wrapped"] == "DistributedDataParallel"
        assert result["steps"] == 4
        _assert_close(result["weights"], reference)
    assert _moved(reference, COMMON["seed"]) > 1e-3  # equality is not the trivial kind


@pytest.mark.parametrize("name", ["accum1", "accum3"])
def test_no_sync_skips_allreduce_on_accumulation_steps(ddp_runs, name):
    # one gradient bucket all-reduce per optimizer step, none on the other micro-steps
    assert [ddp_runs[r][name]["allreduces"] for r in (0, 1)] == [4, 4]


def test_options_reach_ddp(ddp_runs):
    first, second = ddp_runs[0]["options"], ddp_runs[0]["static"]
    assert first["find_unused_parameters"] is True
    assert first["gradient_as_bucket_view"] is False  # asked off
    assert ddp_runs[0]["accum1"]["gradient_as_bucket_view"] is True  # the default
    assert first.get("forward_sync_buffers", first.get("broadcast_buffers")) is False
    assert first["bucket_bytes_cap"] == int(0.5 * 2**20)
    assert second["static_graph"] is True
    assert first["steps"] == second["steps"] == 4


def test_unused_parameters_need_the_flag(ddp_runs):
    for rank in (0, 1):
        assert "find_unused_parameters" in ddp_runs[rank]["unused_no_flag"]["error"]
        assert ddp_runs[rank]["options"]["steps"] == 4  # the same model with the flag trains


def test_checkpoint_keys_are_the_plain_modules(ddp_runs):
    keys = ddp_runs[0]["options"]["keys"]
    assert keys and not any(k.startswith("module.") for k in keys)
    plain = Regression().configure_model()
    plain.load_state_dict(ddp_runs[0]["accum1"]["weights"])  # loads with no key renaming


def test_comm_hooks(ddp_runs, tmp_path):
    reference = ddp_runs[0]["accum1"]["weights"]
    _assert_close(ddp_runs[0]["fp16"]["weights"], reference, 5e-3)
    for name in ("fp16", "powersgd"):  # replicas stay identical under every hook
        _assert_close(ddp_runs[0][name]["weights"], ddp_runs[1][name]["weights"], 0.0)
    psgd = ddp_runs[0]["powersgd"]
    assert psgd["steps"] == 4
    assert psgd["bucket_bytes_cap"] > 0.001 * 2**20  # raised to a single bucket
    # lossy after the warm-up, yet it trains the same model roughly
    assert max((psgd["weights"][k] - reference[k]).abs().max().item() for k in reference) < 0.5


@pytest.mark.slow
def test_cli_ddp_two_ranks_matches_one_process(tmp_path, cpu_backend):
    script = str(__import__("ddp_tasks").__file__)
    args = ["--batch-size", "16", "--max-steps", "6", "--seed", "3", "--grad-accum", "2"]
    toml = tmp_path / "run.toml"
    toml.write_text("[ddp]\nbucket_mb = 1.5\n")  # options come from TOML as well as flags
    ddp = run_cli("run", "--nproc-per-node", "2", "--strategy", "ddp", "--backend", cpu_backend,
                  "--config", str(toml),
                  *args, "--run-dir", str(tmp_path / "ddp"), script,
                  "--out", str(tmp_path / "ddp.pt"), cwd=tmp_path)
    assert ddp.returncode == 0, ddp
    assert "rank 1 done: strategy ddp, model DistributedDataParallel, steps 6" in ddp.stdout
    a = torch.load(tmp_path / "ddp.pt")
    assert not any(k.startswith("module.") for k in a), "saved keys carry DDP's prefix"
    _assert_close(a, single_weights(tmp_path, max_steps=6, seed=3, grad_accum=2))
