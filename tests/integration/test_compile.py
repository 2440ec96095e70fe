"""--compile under ddp, fsdp, tp and pp on 2 gloo ranks: eager and compiled runs agree, keys
stay clean, a checkpoint of a compiled run resumes bit-exact and tests, and the compile time is
said once and kept out of samples/s.

One launch per strategy does it all (process starts and compiles are the cost here): an eager
fit, a compiled fit that checkpoints at steps 3 and 6, a compiled resume from step 3 after
``torch._dynamo.reset()`` (so it compiles again, from the warm cache, as a new process would),
and the test stage of the step-6 checkpoint, compiled and eager. Every launch shares the
session's compile cache (``compile_env``).

Tolerance of compiled against eager: inductor fuses and vectorizes the CPU kernels, so sums
are taken in another order; float32 rounds each at ~6e-8 relative. 6 AdamW steps at lr 1e-2
move each weight by up to ~6e-2, while compiled and eager weights differ by at most 1.7e-7
(measured: ddp 1.7e-7, fsdp 1.2e-7, tp 7.8e-8, pp 1.2e-7; losses within 1e-7). ``rtol=1e-4,
atol=1e-5`` leaves that a margin of 50x, while a wrong gradient (a missed all-reduce, a stale
shard, a stage's gradient dropped) moves a weight by ~1e-2 (AdamW's step is lr-sized).
"""

from __future__ import annotations

import csv
import logging
import os
from typing import Any

import pytest
import torch
from torch import nn

import distrun

pytest.importorskip("distrun_safetensors", reason="the checkpoints need distrun-safetensors")

STRATEGIES = ("ddp", "fsdp", "tp", "pp")
_PLUGIN = {"ddp": "distrun_ddp", "fsdp": "distrun_fsdp", "tp": "distrun_tp",
           "pp": "distrun_pipeline"}


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


class Net(nn.Module):
    """Blocks in a ModuleList (pp splits it), MLP pairs in each block (tp splits them)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(8, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(2))
        self.out = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _data(n: int, seed: int) -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen)
    return torch.utils.data.TensorDataset(x, torch.sin(x.sum(dim=1, keepdim=True)))


class CompileTask(distrun.Task):
    def configure_model(self) -> nn.Module:
        return Net()

    def configure_optimizer(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-2)

    def train_data(self) -> Any:
        return _data(128, 0)

    def val_data(self) -> Any:
        return _data(32, 1)

    def test_data(self) -> Any:
        return _data(32, 2)

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(model(x), y)

    def validation_step(self, model: nn.Module, batch: Any) -> Any:
        x, y = batch
        return {"loss": nn.functional.mse_loss(model(x), y)}

    test_step = validation_step


def _local(run: Any) -> dict[str, torch.Tensor]:
    """This rank's part of every weight (a DTensor's local shard; pp: its own stages')."""
    from torch.distributed.tensor import DTensor

    out = {}
    for key, value in run.unwrapped_model().state_dict().items():
        value = value.to_local() if isinstance(value, DTensor) else value
        out[key] = value.detach().clone()
    return out


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def rank_matrix(rank: int, world: int, root: str, strategy: str) -> dict[str, Any]:
    import torch._dynamo

    from distrun import Trainer

    lines = _Lines()
    logging.getLogger("distrun").addHandler(lines)
    common = dict(strategy=strategy, batch_size=16, max_epochs=1, log_every_n_steps=2,
                  summary=False, seed=0)

    def said() -> list[str]:
        taken = [line for line in lines.lines if line.startswith("torch.compile")]
        lines.lines.clear()
        return taken

    with Trainer(**common, run_dir=f"{root}/eager", max_steps=6) as trainer:
        eager = trainer.fit(CompileTask())
        out: dict[str, Any] = {"eager": _local(eager), "eager_loss": eager.metrics["loss"]}
    said()
    with Trainer(**common, run_dir=f"{root}/whole", compile=True, max_steps=6,
                 ckpt_every_n_steps=3) as trainer:
        whole = trainer.fit(CompileTask())
        out.update(whole=_local(whole), whole_loss=whole.metrics["loss"],
                   keys=sorted(whole.unwrapped_model().state_dict()),
                   wrapped_keys=sorted(whole.model.state_dict()), whole_said=said())
    torch._dynamo.reset()  # the resume compiles again, as a new process would: cache warm
    with Trainer(**common, run_dir=f"{root}/resumed", compile=True, max_steps=6,
                 resume=f"{root}/whole/checkpoints/step-3") as trainer:
        resumed = trainer.fit(CompileTask())
        out.update(resumed=_local(resumed), resumed_from=resumed.resumed_from,
                   resumed_said=said())
    step6 = f"{root}/whole/checkpoints/step-6"
    torch._dynamo.reset()  # the test stage compiles its evaluation, as `--stage test` would
    for name, compiled in (("test_compiled", True), ("test_eager", False)):
        with Trainer(**common, run_dir=f"{root}/{name}", compile=compiled) as trainer:
            out[name] = trainer.test(CompileTask(), ckpt_path=step6)
    out["test_said"] = said()
    logging.getLogger("distrun").removeHandler(lines)
    return out


def _rows(path: str) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_compiled_fit_resume_and_test_under_each_strategy(tmp_path, compile_env, strategy):
    pytest.importorskip(_PLUGIN[strategy], reason=f"needs the plugin of --strategy {strategy}")
    from distrun.testing import run_on_ranks

    results = run_on_ranks(rank_matrix, 2, str(tmp_path), strategy, init_process_group=True,
                           timeout=280)
    for rank, r in enumerate(results):
        # eager and compiled agree (tolerance: the module docstring)
        assert r["whole_loss"] == pytest.approx(r["eager_loss"], rel=1e-4, abs=1e-5)
        for key, value in r["eager"].items():
            torch.testing.assert_close(r["whole"][key], value, rtol=1e-4, atol=1e-5)
        assert not any("_orig_mod" in k for k in r["keys"] + r["wrapped_keys"]), r["keys"]
        # the compiled resume from step 3 ends where the uninterrupted compiled run did
        assert r["resumed_from"].endswith(os.path.join("whole", "checkpoints", "step-3"))
        for key, value in r["whole"].items():
            assert torch.equal(r["resumed"][key], value), f"rank {rank}: {key} after resume"
        # the test stage of the compiled run's checkpoint, compiled and eager
        assert r["test_compiled"].keys() == r["test_eager"].keys() == {"test_loss"}
        assert r["test_compiled"]["test_loss"] == pytest.approx(
            r["test_eager"]["test_loss"], rel=1e-4, abs=1e-5)
    # rank 0 says when compiling starts and how long it took, once per fit; a cold cache
    # builds the graphs, the resume (dynamo reset) loads them
    said = results[0]
    assert len(said["whole_said"]) == 2, said["whole_said"]
    assert said["whole_said"][0].startswith("torch.compile: compiling the model")
    assert "s compiling by the end of the first step" in said["whole_said"][1]
    assert "built" in said["whole_said"][1], said["whole_said"]
    assert len(said["resumed_said"]) == 2, said["resumed_said"]
    # (tp: "partly warm": its training graphs name the process groups, whose names count up
    # in this process; a new process names them as the first did and loads them all)
    assert "warm (" in said["resumed_said"][1] and "loaded" in said["resumed_said"][1], \
        said["resumed_said"]
    assert any("by the end of test" in line for line in said["test_said"]), said["test_said"]
    assert results[1]["whole_said"] == []  # rank 0 only
    # metrics.csv: the first row carries the compile time as compile_s, no later row does
    rows = _rows(str(tmp_path / "whole" / "metrics.csv"))
    train = [row for row in rows if row.get("samples_per_sec")]
    assert float(train[0]["compile_s"]) > 0, rows
    assert all(not row["compile_s"] for row in train[1:]), rows
