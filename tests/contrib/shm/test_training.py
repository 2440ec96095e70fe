"""Training over shm gives gloo's numbers: DDP (with comm hooks), ZeRO, and through
``distrun run --backend shm``: ddp, fsdp (FSDP2) and tp (DTensor)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import torch

from distrun.testing import run_cli, run_on_ranks

sys.path.insert(0, os.path.dirname(__file__))
import shm_ranks  # noqa: E402

EXAMPLE = str(Path(__file__).resolve().parents[3] / "examples" / "tiny_gpt.py")


def test_ddp_and_comm_hooks_bit_equal_to_gloo():
    hooks = ["none", "fp16", "powersgd"]  # bf16_compress_hook: torch allows it on CUDA only
    for per_rank in run_on_ranks(shm_ranks.train_ddp_both, 2, hooks, init_process_group=True,
                                 timeout=120):
        for hook in hooks:
            gloo, shm = per_rank[f"{hook} gloo"], per_rank[f"{hook} shm"]
            # 2 ranks: a + b is the same sum in either backend; half types round once in both
            assert torch.equal(gloo["losses"], shm["losses"]), hook
            for a, b in zip(gloo["weights"], shm["weights"], strict=True):
                assert torch.equal(a, b), hook


def test_zero_redundancy_optimizer_bit_equal_to_gloo():
    for per_rank in run_on_ranks(shm_ranks.zero_both, 2, init_process_group=True, timeout=120):
        for a, b in zip(per_rank["gloo"], per_rank["shm"], strict=True):
            assert torch.equal(a, b)


def _val_losses(output: str) -> list[str]:
    return re.findall(r"val_loss (\d+\.\d+)", output)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp", marks=pytest.mark.extended),
                                      pytest.param("tp", marks=pytest.mark.extended)])
def test_distrun_run_backend_shm_matches_gloo(tmp_path, strategy):
    env = {"TINY_GPT_CHARS": "3000", "TINY_GPT_LAYERS": "2"}
    runs = {}
    for backend in ("gloo", "shm"):
        res = run_cli("run", "--nproc-per-node", "2", "--backend", backend, "--strategy",
                      strategy, "--max-steps", "3", "--timeout", "60", EXAMPLE,
                      cwd=tmp_path, env=env)
        assert res.returncode == 0, res
        runs[backend] = _val_losses(res.output)
    assert runs["shm"] and runs["shm"] == runs["gloo"]
