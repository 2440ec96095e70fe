"""Hugging Face models end to end (examples/hf_causal_lm.py), run as a user would: a model
built from a local config trains on 2 ranks (ddp, fsdp, tp with transformers' own plan; pp
for the Llama, cut at its layers), is saved as a folder that
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


def _losses(run_dir: Path) -> list[float]:
    from distrun._loggers.csv_file import read_metrics

    return [row["loss"] for row in read_metrics(str(run_dir / "metrics.csv")) if "loss" in row]


@pytest.mark.slow
def test_a_transformers_model_under_pipeline_parallel(tmp_path):
    """The Llama cut into 2 stages (--strategy pp, 4 micro-batches of 4): its losses and weights
    follow the one-process run; each stage writes its own shard of the folder, which
    ``from_pretrained`` loads bit-equal to distrun's checkpoint; ``--init-weights`` reads a
    one-process folder into pp and the pp folder into ddp unchanged.

    Tolerances (float32): the last stage averages 4 micro-batch means where one process takes
    one mean over the batch, and the kernels see 4 rows instead of 16, so the sums differ in
    rounding only: losses within 1e-5 (measured 7e-7 over 4 steps); weights within 1e-4
    (measured 4.4e-6: AdamW divides by the gradient's magnitude, so a gradient that is zero up
    to rounding, an unused embedding row, can turn a 1e-9 difference into a step of lr)."""
    import torch
    from transformers import AutoModelForCausalLM

    pytest.importorskip("distrun_pipeline", reason="needs distrun-pipeline")
    common = ("--no-progress", "--max-steps", "4", "--log-every-n-steps", "1")
    one = run_cli("run", "--nproc-per-node", "1", *common, "--name", "one", EXAMPLE,
                  "--save", "one", cwd=tmp_path, timeout=400)
    assert one.returncode == 0, one
    pp = run_cli("run", "--nproc-per-node", "2", "--strategy", "pp", *common, "--name", "pp",
                 "--ckpt-save-on-end", EXAMPLE, "--save", "out", cwd=tmp_path, timeout=400)
    assert pp.returncode == 0, pp
    assert "AutoModelForCausalLM.from_pretrained() loads it" in pp.stdout
    # the automatic split at model.layers: embedding first, norm and head last
    assert "stage 0 (pp rank 0): model.embed_tokens, model.layers.0..1:" in pp.output, pp
    assert "stage 1 (pp rank 1): model.layers.2..3, model.norm, lm_head:" in pp.output, pp
    ref_losses, losses = _losses(tmp_path / "runs" / "one"), _losses(tmp_path / "runs" / "pp")
    assert len(losses) == len(ref_losses) == 4
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    assert losses[-1] < losses[0]

    # One shard per stage, no gathering; transformers loads the folder as it is.
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    by_file: dict[str, set] = {}
    for name, file in index["weight_map"].items():
        by_file.setdefault(file, set()).add(name.split(".")[2] if ".layers." in name else name)
    assert sorted(by_file) == ["model-00001-of-00002.safetensors",
                               "model-00002-of-00002.safetensors"]
    assert by_file["model-00001-of-00002.safetensors"] == {"model.embed_tokens.weight", "0", "1"}
    assert by_file["model-00002-of-00002.safetensors"] == {"2", "3", "model.norm.weight",
                                                           "lm_head.weight"}
    mine = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    consolidated = run_cli("ckpt", "consolidate", "runs/pp/checkpoints/latest", "ref",
                           cwd=tmp_path)
    assert consolidated.returncode == 0, consolidated
    reference = _tensors(tmp_path / "ref")
    assert set(reference) == set(mine) == set(index["weight_map"])
    assert all(torch.equal(mine[k], reference[k]) for k in reference)
    single = _tensors(tmp_path / "one")
    assert set(single) == set(mine)
    assert max((mine[k] - single[k]).abs().max().item() for k in single) < 1e-4

    # --init-weights, at lr 0 (a step keeps the weights exact): one process's folder into pp,
    # the pp folder into ddp.
    for source, strategy, name in (("one", "pp", "into-pp"), ("out", "ddp", "into-ddp")):
        back = run_cli("run", "--nproc-per-node", "2", "--strategy", strategy, "--no-progress",
                       "--max-steps", "1", "--name", name, "--init-weights", source, EXAMPLE,
                       "--lr", "0", "--save", name, cwd=tmp_path, timeout=400)
        assert back.returncode == 0, back
        assert f"Initial weights from {source}:" in back.stdout, back
        want, got = _tensors(tmp_path / source), _tensors(tmp_path / name)
        assert set(got) == set(want)
        assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.slow
def test_gpt2_with_its_tied_head_under_pipeline_parallel(tmp_path):
    """GPT-2's lm_head is its token embedding, which falls in the first stage while the head
    falls in the last: both stages hold the weight and their gradients are summed before each
    step (the tie's gradient parity with one process: tests/plugins/pipeline). The folder holds
    it once, from the first stage's shard, and transformers ties the head back; the folder
    loads back into pp unchanged."""
    import torch
    from transformers import AutoModelForCausalLM

    pytest.importorskip("distrun_pipeline", reason="needs distrun-pipeline")
    common = ("--nproc-per-node", "2", "--strategy", "pp", "--no-progress")
    pp = run_cli("run", *common, "--max-steps", "4", "--name", "pp", "--ckpt-save-on-end",
                 EXAMPLE, "--model", "gpt2", "--save", "out", cwd=tmp_path, timeout=400)
    assert pp.returncode == 0, pp
    assert "stage 1 (pp rank 1): transformer.h.2..3, transformer.ln_f, lm_head:" in pp.output
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]
    assert index["weight_map"]["transformer.wte.weight"] == "model-00001-of-00002.safetensors"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.lm_head.weight is model.transformer.wte.weight
    mine = model.state_dict()
    consolidated = run_cli("ckpt", "consolidate", "runs/pp/checkpoints/latest", "ref",
                           cwd=tmp_path)
    assert consolidated.returncode == 0, consolidated
    reference = _tensors(tmp_path / "ref")
    assert set(reference) == set(mine)
    assert all(torch.equal(mine[k], reference[k]) for k in reference)

    back = run_cli("run", *common, "--max-steps", "1", "--name", "b", "--init-weights", "out",
                   EXAMPLE, "--model", "gpt2", "--lr", "0", "--save", "back", cwd=tmp_path,
                   timeout=400)
    assert back.returncode == 0, back
    saved, again = _tensors(tmp_path / "out"), _tensors(tmp_path / "back")
    assert set(again) == set(saved)
    assert all(torch.equal(again[k], saved[k]) for k in saved)
