"""The tp strategy and the fsdp x tp composition: parity with one process on real gloo ranks."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from torch import nn

from distrun.testing import free_port, run_cli, run_on_ranks

sys.path.insert(0, os.path.dirname(__file__))  # tp_tasks, importable by spawned ranks too
from tp_tasks import EXAMPLE, load_tiny_gpt, max_weight_diff, reference, train_many  # noqa: E402

PLUGINS = "distrun_tp.plugin"
# a loaded 2-core machine needs minutes for the spawned fits (DTensor dispatch is Python-heavy)
pytestmark = pytest.mark.timeout(900)


def _check_parity(ref: dict, out: list[dict]) -> None:
    assert len(ref["losses"]) == 5
    for rank_out in out:
        assert rank_out["losses"] == pytest.approx(ref["losses"], abs=1e-5)
        assert max_weight_diff(ref, rank_out) < 1e-5


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory: pytest.TempPathFactory, cpu_backend: str) -> dict:
    """1-process references (here) and the 2-rank tp fits (one pair of processes)."""
    root = tmp_path_factory.mktemp("tp")
    refs = {"blocks": reference("blocks", options=dict(run_dir=str(root / "single-blocks"))),
            "gpt": reference("gpt", options=dict(run_dir=str(root / "single-gpt"),
                                                 grad_clip=0.5))}
    runs = [("planned", dict(strategy="tp", plugins=PLUGINS, run_dir=str(root / "planned"),
                             port=free_port())),
            ("gpt", dict(strategy="tp", tp_sequence_parallel=True, tp_loss_parallel=True,
                         grad_clip=0.5, plugins=PLUGINS, run_dir=str(root / "gpt"),
                         port=free_port()))]
    per_rank = run_on_ranks(train_many, 2, runs, timeout=240, backend=cpu_backend)
    return {"refs": refs, "planned": [r[0] for r in per_rank], "gpt": [r[1] for r in per_rank]}


def test_tp_with_the_tasks_plan_matches_one_process(tp_runs: dict) -> None:
    out = tp_runs["planned"]
    _check_parity(tp_runs["refs"]["blocks"], out)
    # no data sharding across the tensor-parallel group: every rank sees the whole batch
    assert [o["dp"] for o in out] == [(0, 1), (0, 1)]
    # the task's plan was used: only block 0 is split
    assert out[0]["placements"] == {
        "blocks.0.fc1.weight": ["Shard(dim=0)"], "blocks.0.fc1.bias": ["Shard(dim=0)"],
        "blocks.0.fc2.weight": ["Shard(dim=1)"], "blocks.0.fc2.bias": ["Replicate()"],
    }


def test_tiny_gpt_sequence_and_loss_parallel_match_one_process(tp_runs: dict) -> None:
    out = tp_runs["gpt"]
    _check_parity(tp_runs["refs"]["gpt"], out)
    placements = out[0]["placements"]
    assert placements["blocks.1.attn.q.weight"] == ["Shard(dim=0)"]
    assert placements["blocks.1.mlp.proj.weight"] == ["Shard(dim=1)"]
    assert placements["blocks.0.ln1.weight"] == ["Replicate()"]  # sequence parallel norm
    assert placements["head.weight"] == ["Shard(dim=0)"]  # loss parallel head


@pytest.mark.slow
def test_2d_fsdp_x_tp_on_four_ranks_matches_one_process(tmp_path: Path, cpu_backend: str) -> None:
    pytest.importorskip("distrun_fsdp")
    ref = reference("blocks", options=dict(run_dir=str(tmp_path / "single"), grad_clip=0.5))
    out = run_on_ranks(train_many, 4, [("blocks", dict(
        strategy="fsdp", tp_size=2, grad_clip=0.5, run_dir=str(tmp_path / "2d"),
        plugins="distrun_fsdp.plugin,distrun_tp.plugin"))], timeout=240,
                       backend=cpu_backend)
    out = [o[0] for o in out]
    _check_parity(ref, out)
    # ranks (0,1) and (2,3) are tensor-parallel pairs; the pairs are the 2 data ranks
    assert [o["dp"] for o in out] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert out[0]["placements"]["blocks.0.fc1.weight"] == [
        "_StridedShard(dim=0, sf=2)", "Shard(dim=0)"]
    assert out[0]["placements"]["inp.weight"] == ["Shard(dim=0)"]  # fsdp only, over dp


def test_auto_plan_splits_attention_and_mlp_pairs() -> None:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInputOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    from distrun_tp.parallelize import auto_plan, find_pairs

    gpt = load_tiny_gpt().TinyGPT(vocab=40, dim=32, layers=2)
    assert find_pairs(gpt, 2) == {
        f"blocks.{i}.{m}": pair for i in (0, 1) for m, pair in
        (("attn", (["q", "k", "v"], "proj")), ("mlp", (["fc"], "proj")))}
    plan = auto_plan(gpt, 2, sequence_parallel=True, loss_parallel=True)
    assert isinstance(plan["blocks.0.attn.q"], ColwiseParallel)
    assert isinstance(plan["blocks.0.attn.proj"], RowwiseParallel)
    assert isinstance(plan["blocks.0.ln1"], SequenceParallel)
    assert isinstance(plan["blocks.0"], PrepareModuleInputOutput)
    assert "ln_f" not in plan and "tok" not in plan  # outside the blocks: replicated
    assert isinstance(plan["head"], ColwiseParallel)
    # a 3-wide hidden layer does not split over 2 ranks
    assert find_pairs(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 4)), 2) == {}

    class FusedQKV(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(8, 24)
            self.proj = nn.Linear(8, 8)

    # splitting a fused qkv column-wise would mix q, k and v: left alone
    assert find_pairs(FusedQKV(), 2) == {}


@pytest.mark.parametrize("flags, message", [
    (["--strategy", "single", "--tp-size", "2"],
     "--tp-size 2 needs a strategy that builds a device mesh"),
    (["--strategy", "tp", "--tp-size", "2"],
     "--strategy tp splits layers over all 1 ranks but --tp-size is 2"),
])
@pytest.mark.slow
def test_tp_option_errors_are_one_line(tmp_path: Path, flags: list[str], message: str) -> None:
    env = {"DISTRUN_DISABLE_PLUGIN_AUTOLOAD": "1", "DISTRUN_PLUGINS": PLUGINS,
           "TINY_GPT_CHARS": "3000"}
    res = run_cli("run", *flags, str(EXAMPLE), cwd=tmp_path, env=env)
    assert res.returncode == 2, res
    assert message in res.stderr, res
    assert "Traceback" not in res.output


@pytest.mark.slow
def test_fsdp_tp_degrees_must_divide_the_world(tmp_path: Path) -> None:
    pytest.importorskip("distrun_fsdp")
    env = {"DISTRUN_DISABLE_PLUGIN_AUTOLOAD": "1", "TINY_GPT_CHARS": "3000",
           "DISTRUN_PLUGINS": "distrun_fsdp.plugin,distrun_tp.plugin"}
    res = run_cli("run", "--strategy", "fsdp", "--tp-size", "2", str(EXAMPLE), cwd=tmp_path,
                  env=env)
    assert res.returncode == 2, res
    assert "--tp-size 2 does not divide the world size 1" in res.stderr, res
