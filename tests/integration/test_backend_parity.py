"""Every strategy trains to the same weights over each CPU backend as over gloo.

Run as a user runs it: ``distrun run --backend NAME --strategy S examples/tiny_gpt.py``, a
checkpoint at the end, and the checkpoint files of the two backends compared tensor by tensor.

- Bit-equal where the reduction order is the same: every reduction on 2 ranks (a + b is the
  same float in either order), and collectives that only move bytes (broadcast, all-gather,
  send/recv).
- Within float tolerance where it is not: a sum over 4 ranks (fsdp x tp), where gloo's ring
  adds the ranks' values in a different order than another backend may.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from distrun.testing import cpu_backends, run_cli

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
GPT = str(ROOT / "examples" / "tiny_gpt.py")
OTHERS = [n for n, reason in cpu_backends().items() if n != "gloo" and reason is None]
#: strategy -> (processes, flags, exact): exact means bit-equal to gloo
CASES = {
    "ddp": ("2", ["--strategy", "ddp"], True),
    "ddp-zero": ("2", ["--strategy", "ddp", "--zero"], True),
    "fsdp": ("2", ["--strategy", "fsdp"], True),
    "tp": ("2", ["--strategy", "tp"], True),
    "pp": ("2", ["--strategy", "pp"], True),
    "fsdp-tp": ("4", ["--strategy", "fsdp", "--tp-size", "2"], False),
}


def _train(tmp_path: Path, backend: str, case: str) -> tuple[dict, list[float]]:
    from safetensors.torch import load_file

    nproc, flags, _ = CASES[case]
    run_dir = tmp_path / f"{case}-{backend}"
    env = {"TINY_GPT_DIM": "32", "TINY_GPT_LAYERS": "2", "TINY_GPT_CHARS": "20000",
           "DISTRUN_TIMEOUT": "120"}
    result = run_cli("run", "--nproc-per-node", nproc, "--backend", backend, *flags,
                     "--max-steps", "4", "--log-every-n-steps", "1", "--batch-size", "8",
                     "--seed", "11", "--ckpt-save-on-end", "--run-dir", str(run_dir), GPT,
                     env=env, timeout=600)
    assert result.returncode == 0, result
    step = run_dir / "checkpoints" / "step-4"
    tensors = {}
    for path in sorted(step.glob("*.safetensors")):
        for key, value in load_file(str(path)).items():
            tensors[f"{path.name}:{key}"] = value
    assert tensors, f"no checkpoint files in {step}"
    with open(run_dir / "metrics.csv") as fh:
        losses = [float(row["loss"]) for row in csv.DictReader(fh) if row.get("loss")]
    return tensors, losses


@pytest.mark.skipif(not OTHERS, reason="no CPU backend other than gloo can run here "
                                       "(pip install distrun-shm)")
@pytest.mark.parametrize("backend", OTHERS or ["none"])
@pytest.mark.parametrize("case", [  # ddp by default, the other strategies in `extended`
    pytest.param(c, marks=() if c == "ddp" else pytest.mark.extended) for c in CASES])
def test_same_weights_as_gloo(tmp_path, backend, case):
    ref, ref_losses = _train(tmp_path, "gloo", case)
    got, losses = _train(tmp_path, backend, case)
    assert sorted(got) == sorted(ref)
    assert len(losses) == len(ref_losses) == 4
    exact = CASES[case][2]
    import torch

    for key, want in ref.items():
        if exact:
            assert torch.equal(got[key], want), f"{case} over {backend}: {key} differs from gloo"
        else:
            torch.testing.assert_close(got[key], want, rtol=1e-5, atol=1e-6,
                                       msg=f"{case} over {backend}: {key}")
    if exact:
        assert losses == ref_losses
    else:
        assert losses == pytest.approx(ref_losses, rel=1e-5)
