"""The fsdp strategy: parity with one process, sharded state, options, errors (real gloo ranks)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from distrun.plugin import UsageError, hookimpl
from distrun.testing import free_port, imports_torch, run_cli, run_on_ranks

sys.path.insert(0, os.path.dirname(__file__))  # fsdp_tasks, importable by spawned ranks too
from fsdp_tasks import Block, Net, max_weight_diff, reference, train_many  # noqa: E402

EXAMPLE = str(Path(__file__).resolve().parents[3] / "examples" / "tiny_gpt.py")
ONLY_FSDP = {"DISTRUN_DISABLE_PLUGIN_AUTOLOAD": "1", "DISTRUN_PLUGINS": "distrun_fsdp.plugin"}
# a loaded 2-core machine needs minutes for the spawned fits
pytestmark = pytest.mark.timeout(900)
# gradient accumulation (no_sync on odd micro-steps) and clipping in every parity run
COMMON = dict(grad_accum=2, grad_clip=0.5)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, cpu_backend: str) -> dict:
    """The 1-process reference (in this process) and the 2-rank fits (one pair of processes)."""
    root = tmp_path_factory.mktemp("fsdp")
    ref = reference(options=dict(run_dir=str(root / "single"), **COMMON))
    rank0, rank1 = run_on_ranks(train_many, 2, [
        dict(strategy="fsdp", run_dir=str(root / "fsdp"), port=free_port(), **COMMON),
        dict(strategy="fsdp", run_dir=str(root / "hsdp"), port=free_port(),
             fsdp_replicate_degree=2, fsdp_cpu_offload=True, fsdp_reshard_after_forward=False,
             **COMMON),
    ], timeout=240, backend=cpu_backend)
    return {"single": ref, "fsdp": [rank0[0], rank1[0]], "hsdp": [rank0[1], rank1[1]]}


def _check_parity(reference: dict, out: list[dict]) -> None:
    assert len(reference["losses"]) == 4  # 128 samples, global batch 16, 2 micro-steps per step
    for rank_out in out:
        assert rank_out["losses"] == pytest.approx(reference["losses"], abs=1e-5)
        assert max_weight_diff(reference, rank_out) < 1e-5


def test_fsdp_two_ranks_match_one_process(runs: dict) -> None:
    reference, out = runs["single"], runs["fsdp"]
    _check_parity(reference, out)
    # every rank trains on its half of the global batch
    assert [o["dp"] for o in out] == [(0, 2), (1, 2)]
    # the mesh's sub-groups time out like the run (--timeout), not after torch's 30 minutes
    assert out[0]["timeout"] < 1800
    timeouts = [t for t in out[0]["mesh_timeouts"] if t is not None]
    assert len(out[0]["mesh_timeouts"]) == 2 and timeouts == [out[0]["timeout"]] * len(timeouts)
    assert timeouts or out[0]["backend"] != "gloo", "gloo's sub-groups tell their timeout"
    # parameters and optimizer state are DTensors sharded over the ranks: half each
    assert out[0]["param_types"] == ["DTensor"]
    assert "DTensor" in out[0]["opt_state_types"]
    total = sum(p.numel() for p in Net().parameters())
    assert sum(o["local_numel"] for o in out) == total
    assert max(o["local_numel"] for o in out) <= total // 2 + 64
    assert sum(o["opt_numel"] for o in out) == 2 * total  # Adam: exp_avg + exp_avg_sq
    # no reduce-scatter inside no_sync: odd micro-steps leave .grad unset, even ones set it
    n = len(list(Net().parameters()))
    assert out[0]["grads_after"][:4] == [0, n, 0, n]
    assert reference["grads_after"][:2] == [n, n]


def test_hsdp_with_cpu_offload_matches_one_process(runs: dict) -> None:
    reference, out = runs["single"], runs["hsdp"]
    _check_parity(reference, out)
    assert [o["dp"] for o in out] == [(0, 2), (1, 2)]
    # HSDP: replicated over the 2 groups, sharded within each (of 1 rank here)
    assert out[0]["placements"] == ["(Replicate(), Shard(dim=0))"]
    total = sum(p.numel() for p in Net().parameters())
    assert out[0]["local_numel"] == total


def test_find_blocks_default_and_by_class_name() -> None:
    from distrun_fsdp.wrap import find_blocks

    net = Net(depth=3)
    assert find_blocks(net) == list(reversed(list(net.blocks)))
    seq = nn.Sequential(Block(4), Block(4), nn.Linear(4, 4), nn.Linear(4, 4))
    assert find_blocks(seq) == [seq[1], seq[0]]  # repeated composite layers, not Linears
    assert find_blocks(net, ["Block", " LayerNorm"])[0] is net.blocks[2].norm
    assert len(find_blocks(net, ["Block", "LayerNorm"])) == 6
    with pytest.raises(UsageError, match="--fsdp-wrap names Nope"):
        find_blocks(net, ["Nope"])


@pytest.mark.slow
def test_bf16_mixed_precision_through_the_cli(tmp_path: Path) -> None:
    script = tmp_path / "bf16_task.py"
    script.write_text(
        "import torch, distrun\n"
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from fsdp_tasks import BlocksTask\n"
        "class T(BlocksTask):\n"
        "    def training_step(self, model, batch):\n"
        "        out = model(batch[0])\n"
        "        print('logits dtype', out.dtype, flush=True)\n"
        "        return torch.nn.functional.mse_loss(out.float(), batch[1])\n"
        "distrun.fit(T(), max_steps=2, batch_size=16)\n"
    )
    res = run_cli("run", "--nproc-per-node", "2", "--strategy", "fsdp", "--fsdp-param-dtype",
                  "bfloat16", "--fsdp-reduce-dtype", "bfloat16", "--fsdp-wrap", "Block",
                  "--timeout", "120", str(script), cwd=tmp_path, env=ONLY_FSDP)
    assert res.returncode == 0, res
    assert "logits dtype torch.bfloat16" in res.output, res


@pytest.mark.parametrize("flags, message", [
    (["--fsdp-wrap", "Nope"], "--fsdp-wrap names Nope but the model has no module"),
    (["--fsdp-replicate-degree", "3"], "not divisible by 3"),
])
@pytest.mark.slow
def test_option_errors_are_one_line(tmp_path: Path, flags: list[str], message: str) -> None:
    env = {**ONLY_FSDP, "TINY_GPT_CHARS": "3000"}
    res = run_cli("run", "--strategy", "fsdp", *flags, EXAMPLE, cwd=tmp_path, env=env)
    assert res.returncode == 2, res
    assert message in res.stderr, res
    assert "Traceback" not in res.output


def test_plugin_module_does_not_import_torch() -> None:

    assert not imports_torch("distrun_fsdp.plugin")


def test_clip_grad_norm_on_plain_tensors_matches_torch() -> None:
    from distrun_fsdp.strategy import clip_grad_norm

    torch.manual_seed(0)
    a, b = nn.Linear(4, 3), nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    for m in (a, b):
        m(torch.ones(2, 4)).sum().mul(10).backward()
    mine = clip_grad_norm(a.parameters(), 0.5)
    ref = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.5)
    assert float(mine) == pytest.approx(float(ref), rel=1e-6)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-7)


class _PublishesTp:
    """A plugin that owns a tp dimension without being distrun-tp (no --tp-size option)."""

    @hookimpl
    def distrun_parallel_degrees(self, config):
        return {"tp": 2}


def test_the_launcher_reads_the_published_tp_degree_not_the_tp_option() -> None:
    import distrun_fsdp.plugin
    import distrun_tp.plugin
    from distrun._config.run_config import resolve_config
    from distrun._registry.collect import collect_options, collect_strategies
    from distrun._registry.manager import make_plugin_manager

    for plugins, flags in (([distrun_fsdp.plugin, _PublishesTp()], {}),
                           ([distrun_fsdp.plugin, distrun_tp.plugin], {"tp_size": "2"}),
                           ([distrun_fsdp.plugin, distrun_tp.plugin], {})):
        pm = make_plugin_manager(autoload=False)
        for plugin in plugins:
            pm.register(plugin)
        config = resolve_config(collect_options(pm), flags=flags, environ={}, pluginmanager=pm)
        fsdp = collect_strategies(pm)["fsdp"]
        want = 4 if plugins[1] is distrun_tp.plugin and not flags else 2
        assert fsdp.data_parallel_size(config, 4) == want, (plugins, flags)
