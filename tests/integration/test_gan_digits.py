"""The GAN example (two models, two optimizers, manual optimization) run as a user would:
2 gloo ranks, stopped mid-run by a signal and resumed, bit-equal to an uninterrupted run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from distrun.testing import run_cli

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "gan_digits.py"
HERE = Path(__file__).resolve().parent

pytest.importorskip("distrun_safetensors", reason="the resume test needs distrun-safetensors")


def _env(**extra: str) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
            "DISTRUN_PLUGINS": "gan_stop_plugin", "DISTRUN_TIMEOUT": "120",
            "OMP_NUM_THREADS": "1", **extra}


def _gan(run_dir: Path, strategy: str, *flags: str, **env: str):
    # 1,797 images / 64 = 28 steps an epoch: 40 steps cross an epoch's end
    return run_cli("run", "--nproc-per-node", "2", "--strategy", strategy, "--seed", "5",
                   "--max-epochs", "2", "--max-steps", "40", "--ckpt-save-on-end",
                   "--grad-clip", "1.0", "--log-every-n-steps", "10", "--run-dir",
                   str(run_dir), *flags, str(EXAMPLE), env=_env(**env), cwd=run_dir.parent,
                   timeout=400)


def _tensors(folder: Path) -> dict[str, object]:
    """Every tensor of a checkpoint folder, by file and name (same world size: same files)."""
    from safetensors.torch import load_file

    found = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            for key, value in load_file(str(folder / name)).items():
                found[f"{name}:{key}"] = value
    return found


def _load_example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gan_digits_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rank_gan_steps(rank, world, root, strategy, precision):
    """6 manual steps of the GAN; what each optimizer step saw (its parameters' gradient
    norm after clipping), the weights, and each optimizer's state."""
    import torch

    import distrun
    from distrun import Trainer

    seen = []

    class StepProbe:
        @staticmethod
        @distrun.hookimpl(wrapper=True)
        def distrun_optimizer_step(run):
            result = yield
            params = list(run.model.parameters())  # this optimizer's, during its step
            grads = [p.grad for p in params if p.grad is not None]
            seen.append((sum(p.numel() for p in params), float(torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(g.full_tensor() if hasattr(g, "full_tensor") else g)
                 for g in grads])))))
            return result

    task = _load_example().GanTask()
    run = Trainer(plugins=(StepProbe(),), strategy=strategy, precision=precision,
                  batch_size=64, max_steps=6, seed=5, grad_clip=0.05, summary=False,
                  run_dir=f"{root}/run", log_every_n_steps=3).fit(task)
    opt_g, opt_d = task.optimizers()
    weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
               for k, v in run.unwrapped_model().state_dict().items()}
    steps = [int(next(iter(o.state.values()))["step"]) for o in (opt_g, opt_d)]
    lrs = [o.param_groups[0]["lr"] for o in (opt_g, opt_d)]
    return {"seen": seen, "weights": weights, "steps": steps, "lrs": lrs,
            "metrics": dict(run.metrics), "step": run.progress.step,
            "sizes": [sum(p.numel() for g in o.param_groups for p in g["params"])
                      for o in (opt_g, opt_d)]}


@pytest.mark.parametrize("strategy,precision", [("ddp", "bf16-mixed")])
def test_gan_trains_on_two_ranks_with_two_optimizers_clipped_each(tmp_path, strategy,
                                                                   precision):
    """The fast lane's GAN: 6 manual steps on 2 gloo ranks under ddp and bf16 autocast."""
    pytest.importorskip("distrun_ddp")
    pytest.importorskip("distrun_amp")
    import torch

    from distrun.testing import run_on_ranks

    results = run_on_ranks(rank_gan_steps, 2, str(tmp_path), strategy, precision,
                           timeout=240)
    for r in results:
        assert r["step"] == 6 and r["steps"] == [6, 6], r["steps"]  # a step = one batch
        # each optimizer stepped with only its own model's parameters, clipped to 0.05
        assert len(r["seen"]) == 12
        assert {n for n, _ in r["seen"]} == set(r["sizes"])
        assert all(norm <= 0.05 * (1 + 1e-3) for _, norm in r["seen"]), r["seen"]
        assert r["lrs"] == [pytest.approx(2e-4 * 0.999 ** 6)] * 2  # the task's schedulers
        assert {"d_loss", "g_loss", "d_real"} <= set(r["metrics"])
        assert "loss" not in r["metrics"]  # the steps return nothing: no loss column
    first, second = (r["weights"] for r in results)
    assert {k.split(".")[0] for k in first} == {"generator", "discriminator"}
    assert all(torch.equal(first[k], second[k]) for k in first)  # DDP kept them in sync


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_gan_stopped_mid_run_resumes_bit_equal_to_an_uninterrupted_run(tmp_path, strategy):
    import torch

    whole = _gan(tmp_path / "whole", strategy)
    assert whole.returncode == 0, whole
    assert "d_loss" in whole.stdout and "g_loss" in whole.stdout, whole

    cut_dir = tmp_path / "cut"
    cut = _gan(cut_dir, strategy, GAN_STOP_AT="9")
    assert cut.returncode == 143, cut  # stopped, its checkpoint saved, asking for a requeue
    saved = sorted(p.name for p in (cut_dir / "checkpoints").iterdir()
                   if p.name.startswith("step-"))
    assert len(saved) == 1 and 9 <= int(saved[0].split("-")[1]) < 40, saved
    resumed = _gan(cut_dir, strategy, "--resume", "latest")
    assert resumed.returncode == 0, resumed
    assert f"Resumed from {cut_dir / 'checkpoints' / saved[0]}" in resumed.output, resumed

    want = _tensors(tmp_path / "whole" / "checkpoints" / "step-40")
    got = _tensors(cut_dir / "checkpoints" / "step-40")
    assert set(got) == set(want)
    names = {k.split(":", 1)[1].split("@")[0] for k in want}  # (fsdp: "@offset" pieces)
    for model in ("generator", "discriminator"):  # both models, both optimizers' states
        assert any(n.startswith(f"{model}.") and "/" not in n for n in names), names
        assert any(n.startswith(f"{model}.") and n.endswith("/exp_avg_sq") for n in names), names
    differ = [k for k in want if not torch.equal(want[k], got[k])]
    assert not differ, f"{len(differ)} of {len(want)} tensors differ after resume: {differ[:5]}"
    # the schedulers' states (stepped 40 times) and the optimizers' step counts came back too
    import json

    def states(run: str) -> list[object]:
        folder = tmp_path / run / "checkpoints" / "step-40"
        return [json.loads((folder / n).read_text()) for n in sorted(os.listdir(folder))
                if n.endswith(".json") and n.startswith(("optimizer", "state"))]

    assert states("cut") == states("whole")


@pytest.mark.slow
def test_grad_accum_under_manual_optimization_is_refused_in_one_line(tmp_path):
    result = run_cli("run", "--grad-accum", "2", "--max-steps", "1", str(EXAMPLE),
                     cwd=tmp_path, env={"OMP_NUM_THREADS": "1"}, timeout=300)
    assert result.returncode == 2, result
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1] == ("error: --grad-accum 2: GanTask steps its optimizers itself "
                         "(automatic_optimization = False), so gradient accumulation is its "
                         "own to do; drop --grad-accum (or grad_accum=) and accumulate in "
                         "training_step"), result
    assert "Traceback" not in result.output, result
