"""Hugging Face models end to end (examples/hf_causal_lm.py), run as a user would: a model
built from a local config trains on 2 ranks (ddp, fsdp, tp with transformers' own plan), is saved as a folder that
``AutoModelForCausalLM.from_pretrained`` loads bit-equal to distrun's own checkpoint of the
same step, and ``--init-weights`` reads that folder back into another strategy unchanged."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from distrun.testing import run_cli

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "hf_causal_lm.py")


def _missing(*names: str) -> bool:
    return any(importlib.util.find_spec(name) is None for name in names)


pytestmark = [
    pytest.mark.skipif(_missing("transformers"),
                       reason="needs transformers (requirements-dev.txt pins it)"),
    pytest.mark.skipif(_missing("distrun_ddp", "distrun_fsdp", "distrun_safetensors"),
                       reason="needs distrun-ddp, distrun-fsdp and distrun-safetensors"),
]


def _tensors(folder: Path) -> dict:
    """Every tensor of a safetensors folder (one file, or an index and its shards)."""
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) \
        if index.exists() else ["model.safetensors"]
    out: dict = {}
    for name in files:
        out.update(load_file(str(folder / name)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "train", "reload"), [("llama", "ddp", "fsdp"),
                                                       ("gpt2", "fsdp", "ddp"),
                                                       ("llama", "tp", "fsdp")])
def test_a_transformers_model_trains_saves_and_loads_back(tmp_path, kind, train, reload):
    import torch
    from transformers import AutoModelForCausalLM

    common = ("--nproc-per-node", "2", "--no-progress")
    result = run_cli("run", *common, "--strategy", train, "--max-steps", "4", "--name", "t",
                     "--ckpt-save-on-end", EXAMPLE, "--model", kind, "--save", "out",
                     cwd=tmp_path, timeout=400)
    assert result.returncode == 0, result
    assert "AutoModelForCausalLM.from_pretrained() loads it" in result.stdout
    if train == "tp":  # split by transformers' own plan, not the automatic one
        assert "the task's parallelize_plan" in result.stdout, result

    # The folder loads with transformers alone, bit-equal to distrun's checkpoint of step 4.
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    mine = model.state_dict()
    consolidated = run_cli("ckpt", "consolidate", "runs/t/checkpoints/latest", "ref",
                           cwd=tmp_path)
    assert consolidated.returncode == 0, consolidated
    reference = _tensors(tmp_path / "ref")
    assert set(reference) == set(mine)
    assert all(torch.equal(mine[k], reference[k]) for k in reference)
    saved = _tensors(tmp_path / "out")
    if kind == "gpt2":  # tied: written once, as transformers writes it, and tied back on load
        assert "lm_head.weight" not in saved and "transformer.wte.weight" in saved
        assert model.lm_head.weight is model.transformer.wte.weight
    assert set(saved) | {"lm_head.weight"} >= set(mine)

    # --init-weights reads the folder into the other strategy; a step at lr 0 keeps it exact.
    back = run_cli("run", *common, "--strategy", reload, "--max-steps", "1", "--name", "b",
                   "--init-weights", "out", EXAMPLE, "--model", kind, "--lr", "0", "--save",
                   "back", cwd=tmp_path, timeout=400)
    assert back.returncode == 0, back
    assert "Initial weights from out:" in back.stdout, back
    again = _tensors(tmp_path / "back")
    assert set(again) == set(saved)
    assert all(torch.equal(again[k], saved[k]) for k in saved)
