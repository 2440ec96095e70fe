"""ZeroRedundancyOptimizer over DDP: same training as plain Adam, half the state per rank."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

from distrun.testing import run_on_ranks

sys.path.insert(0, os.path.dirname(__file__))  # zero_tasks, importable by spawned ranks too
from zero_tasks import TwoOptimizers, fit_zero  # noqa: E402

COMMON = dict(strategy="ddp", batch_size=16, max_steps=6, seed=2, timeout=120)
HAVE_JOIN = importlib.util.find_spec("distrun_join") is not None
RUNS = {"adam": dict(COMMON), "zero": dict(COMMON, zero=True),
        "adamw": dict(COMMON, adamw=True), "zero_adamw": dict(COMMON, zero=True, adamw=True)}
if HAVE_JOIN:  # ZeRO is a Joinable: the join plugin puts it in the Join context with DDP
    RUNS["zero_join"] = dict(COMMON, zero=True, max_steps=-1, uneven=(5, 8))


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory, cpu_backend):
    run_dir = str(tmp_path_factory.mktemp("zero"))
    runs = [dict(opts, run_dir=run_dir) for opts in RUNS.values()]
    out = run_on_ranks(fit_zero, 2, runs, timeout=200, init_process_group=True,
                       backend=cpu_backend)
    return [dict(zip(RUNS, per_rank, strict=True)) for per_rank in out]


@pytest.mark.parametrize("plain_name, zero_name, kind", [("adam", "zero", "Adam"),
                                                         ("adamw", "zero_adamw", "AdamW")])
def test_zero_matches_the_plain_optimizer(zero_runs, plain_name, zero_name, kind):
    for rank in (0, 1):
        plain, zero = zero_runs[rank][plain_name], zero_runs[rank][zero_name]
        assert plain["optimizer"] == kind and zero["optimizer"] == "ZeroOptimizer"
        assert zero["steps"] == plain["steps"] == 6
        for name, value in plain["weights"].items():
            diff = (zero["weights"][name] - value).abs().max().item()
            assert diff <= 1e-6, f"{name}: {diff:.3g}"


def test_optimizer_state_per_rank_about_halves(zero_runs, capsys):
    plain = [zero_runs[r]["adam"]["state_bytes"] for r in (0, 1)]
    zero = [zero_runs[r]["zero"]["state_bytes"] for r in (0, 1)]
    with capsys.disabled():
        print(f"\noptimizer state bytes per rank: Adam {plain}, ZeRO {zero} "
              f"(ratio {zero[0] / plain[0]:.3f}, {zero[1] / plain[1]:.3f})")
    assert plain[0] == plain[1] > 0
    assert sum(zero) == plain[0]  # the shards partition the state exactly
    for z in zero:
        assert 0.4 <= z / plain[0] <= 0.6


def test_state_dict_is_whole_and_portable(zero_runs):
    for rank in (0, 1):
        plain = zero_runs[rank]["adam"]["full_state"]
        zero = zero_runs[rank]["zero"]["full_state"]
        assert sorted(zero["state"]) == sorted(plain["state"]) == list(range(16))
        for idx, entry in plain["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(zero["state"][idx][key], entry[key],
                                           rtol=1e-5, atol=1e-7)
        assert zero_runs[rank]["zero"]["bytes_after_load"] == \
            zero_runs[rank]["zero"]["state_bytes"]
        assert zero_runs[rank]["zero"]["layout"] == {
            "sharded": True, "world_size": 2, "optimizer_class": "Adam",
            "format": "consolidated"}


@pytest.mark.skipif(not HAVE_JOIN, reason="distrun-join is not installed")
def test_zero_with_join_on_uneven_inputs(zero_runs):
    a, b = zero_runs[0]["zero_join"], zero_runs[1]["zero_join"]
    assert a["steps"] == b["steps"] == 8
    for name, value in a["weights"].items():
        torch.testing.assert_close(b["weights"][name], value, rtol=0, atol=0)
    # the optimizer shards stayed consistent: the whole state is the same on both ranks
    for idx, entry in a["full_state"]["state"].items():
        torch.testing.assert_close(b["full_state"]["state"][idx]["exp_avg"], entry["exp_avg"])


@pytest.mark.skipif(importlib.util.find_spec("distrun_safetensors") is None,
                    reason="distrun-safetensors is not installed")
@pytest.mark.slow
def test_checkpoint_resume_with_zero_matches_an_uninterrupted_run(tmp_path):
    from distrun.testing import run_cli

    script = os.path.join(os.path.dirname(__file__), "zero_tasks.py")
    common = ["--nproc-per-node", "2", "--strategy", "ddp", "--zero", "--batch-size", "16",
              "--seed", "2", "-p", "no:progress"]
    whole = run_cli("run", *common, "--max-steps", "6", "--run-dir", str(tmp_path / "a"),
                    script, str(tmp_path / "whole.pt"), cwd=tmp_path)
    assert whole.returncode == 0, whole
    first = run_cli("run", *common, "--max-steps", "3", "--ckpt-every-n-steps", "3",
                    "--run-dir", str(tmp_path / "b"), script, str(tmp_path / "half.pt"),
                    cwd=tmp_path)
    assert first.returncode == 0, first
    second = run_cli("run", *common, "--max-steps", "6", "--resume", "auto", "--run-dir",
                     str(tmp_path / "b"), script, str(tmp_path / "resumed.pt"), cwd=tmp_path)
    assert second.returncode == 0, second
    assert "Resumed from" in second.stdout, second
    a, b = torch.load(tmp_path / "whole.pt"), torch.load(tmp_path / "resumed.pt")
    for name in a:  # Adam's moments came back through the checkpoint, shard by shard
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0)


@pytest.mark.slow
def test_zero_refuses_manual_optimization_in_one_line(distrun_pm, tmp_path, capsys):
    import distrun
    import distrun_zero.plugin

    with pytest.raises(SystemExit) as exited:
        distrun.Trainer(plugins=(distrun_zero.plugin,), zero=True, max_steps=1, batch_size=16,
                        summary=False, run_dir=str(tmp_path / "run")).fit(TwoOptimizers())
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert [ln for ln in err.splitlines() if ln.startswith("error: ")] == [
        "error: --zero shards the one optimizer the loop steps, but TwoOptimizers steps its "
        "optimizers itself (automatic_optimization = False with 2 optimizers); drop --zero "
        "(--strategy fsdp shards every optimizer's state)"], err
    assert "Traceback" not in err
