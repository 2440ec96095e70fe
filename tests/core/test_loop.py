"""The loop: accumulation, determinism, max_steps, validation, metrics, multi-rank parity."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from distrun import Trainer
from distrun.testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from tiny_task import TinyTask  # noqa: E402


def weights(run) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in run.unwrapped_model().state_dict().items()}


def fit(tmp_path, **options):
    options.setdefault("summary", False)
    return Trainer(run_dir=str(tmp_path / "run"), **options).fit(TinyTask())


def test_same_seed_same_weights_bit_for_bit(distrun_pm, tmp_path):
    a = weights(fit(tmp_path, max_steps=6, batch_size=32))
    b = weights(fit(tmp_path, max_steps=6, batch_size=32))
    for k in a:
        assert torch.equal(a[k], b[k]), k
    c = weights(fit(tmp_path, max_steps=6, batch_size=32, seed=1))
    assert not torch.equal(a["0.weight"], c["0.weight"])


def test_grad_accumulation_matches_the_bigger_batch(distrun_pm, tmp_path):
    big = fit(tmp_path, max_steps=5, batch_size=32)
    accum = fit(tmp_path, max_steps=5, batch_size=16, grad_accum=2)
    assert big.progress.step == accum.progress.step == 5
    assert accum.progress.micro_step == 10
    for k, v in weights(big).items():
        torch.testing.assert_close(weights(accum)[k], v, rtol=0, atol=1e-6)


def test_max_steps_and_epochs(distrun_pm, tmp_path):
    run = fit(tmp_path, max_steps=3, batch_size=32)
    assert run.progress.step == 3 and run.progress.epoch == 0
    run = fit(tmp_path, max_epochs=2, batch_size=64)  # 256 samples -> 4 steps an epoch
    assert run.progress.step == 8 and run.progress.epoch == 2


def test_metrics_and_validation(distrun_pm, tmp_path):
    run = fit(tmp_path, max_epochs=3, batch_size=32, log_every_n_steps=4)
    m = run.metrics
    assert {"loss", "samples_per_sec", "lr", "val_loss", "epoch", "step"} <= set(m)
    assert m["lr"] == pytest.approx(0.05)
    assert m["samples_per_sec"] > 0
    # the model learns the linear target: validation loss far below the initial one
    first = fit(tmp_path, max_steps=1, batch_size=32).metrics["val_loss"]
    assert m["val_loss"] < 0.5 * first


def test_model_summary_table(distrun_pm, tmp_path, capsys):
    from distrun._train.summary import model_summary

    text = model_summary(TinyTask().configure_model())
    lines = text.splitlines()
    assert lines[0].split("|")[1:] == [" Name ", " Type   ", " Params"]
    assert "0 | 0    | Linear | 144" in text
    assert "1 | 1    | Tanh   | 0" in text
    assert "161        Total params" in text
    assert "0.001      Total estimated model params size (MB)" in text


def _two_rank_fit(rank, world, run_dir, accum):
    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_task import TinyTask

    from distrun._registry.manager import make_plugin_manager

    pm = make_plugin_manager(autoload=False, extra=["allreduce_strategy"])
    run = Trainer(plugin_manager=pm, strategy="allreduce", max_steps=6, batch_size=32, grad_accum=accum,
                  run_dir=run_dir, summary=False, log_every_n_steps=3).fit(TinyTask())
    return {k: v.detach().clone() for k, v in run.model.state_dict().items()}, run.metrics


@pytest.mark.parametrize("accum", [1, 2])
def test_two_ranks_match_one_process(distrun_pm, tmp_path, accum):
    """The sampler splits each global batch; averaged gradients equal the 1-process ones."""
    single = fit(tmp_path, max_steps=6, batch_size=32, grad_accum=accum, log_every_n_steps=3)
    results = run_on_ranks(_two_rank_fit, 2, str(tmp_path / "r2"), accum, timeout=120)
    (w0, m0), (w1, m1) = results
    for k, v in weights(single).items():
        torch.testing.assert_close(w0[k], v, rtol=0, atol=1e-6)
        assert torch.equal(w0[k], w1[k])
    # the logged loss is reduced across ranks: identical on both, close to 1-process's
    assert m0["loss"] == m1["loss"]
    assert m0["loss"] == pytest.approx(single.metrics["loss"], rel=1e-4)


def test_run_generation_comes_from_the_launch_environment(distrun_pm, tmp_path, monkeypatch,
                                                          capsys):
    """`run.generation`: the rendezvous round an elastic agent exports (0 without one)."""
    from distrun._launch.generation import GENERATION_ENV

    monkeypatch.delenv(GENERATION_ENV, raising=False)
    assert fit(tmp_path, max_steps=1, batch_size=32).generation == 0
    monkeypatch.setenv(GENERATION_ENV, "7")
    assert fit(tmp_path, max_steps=1, batch_size=32).generation == 7
    monkeypatch.setenv(GENERATION_ENV, "-1")
    with pytest.raises(SystemExit) as info:
        fit(tmp_path, max_steps=1, batch_size=32)
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        "error: DISTRUN_RDZV_GENERATION='-1' is not a rendezvous generation (a whole number "
        ">= 0, set by the elastic agent; unset it)\n")


def _fits_on_one_port(rank, world, run_dir):
    import time

    from distrun._registry.manager import make_plugin_manager

    out = []
    for i in range(3):
        pm = make_plugin_manager(autoload=False, extra=["allreduce_strategy"])
        run = Trainer(plugin_manager=pm, strategy="allreduce", max_steps=4, batch_size=32,
                      run_dir=f"{run_dir}/{i}", summary=False, timeout=20).fit(TinyTask())
        out.append({k: v.detach().clone() for k, v in run.model.state_dict().items()})
        if rank == 0:
            time.sleep(2.0)  # rank 1 meets the next fit while this rank's group is still up
    return out


def test_fits_one_after_another_on_one_port_each_meet_their_own_group(distrun_pm, tmp_path):
    """A notebook's or a sweep's fits in one process, the port the same (MASTER_PORT): the
    next fit's rendezvous reaches rank 0 while rank 0 still holds the last fit's group; it
    must meet the next fit's ranks, not the keys of the last (a gloo connect to a closed port,
    or a client cut when rank 0 closes the last fit's store)."""
    single = weights(fit(tmp_path, max_steps=4, batch_size=32))
    per_rank = run_on_ranks(_fits_on_one_port, 2, str(tmp_path / "r2"), timeout=120)
    for fits in per_rank:
        assert len(fits) == 3
        for state in fits:
            for k, v in single.items():
                torch.testing.assert_close(state[k], v, rtol=0, atol=1e-6)
