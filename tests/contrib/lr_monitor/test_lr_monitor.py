"""distrun-lr-monitor: a real 2-rank run's metrics.csv holds every group's exact rates."""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path

import pytest

import distrun
from distrun.testing import imports_torch, run_cli, run_on_ranks
from distrun_lr_monitor.plugin import group_names

HERE = Path(__file__).resolve().parent
TASK = f"{HERE / 'lr_tasks.py'}:TwoGroups"
sys.path.insert(0, str(HERE))  # lr_tasks, importable by spawned ranks too
from lr_tasks import STEPS, make_model, make_optimizer, make_schedule  # noqa: E402

KEYS = ("lr-body", "lr-pg1", "momentum-body", "momentum-pg1")


def expected_after_each_step() -> dict[int, dict[str, float]]:
    """The task's optimizer and OneCycle schedule replayed here: each group's lr and momentum
    after step s (its scheduler step included), as metrics.csv writes them (8 digits)."""
    opt = make_optimizer(make_model().parameters())
    sched = make_schedule(opt)
    out = {}
    for step in range(1, STEPS + 1):
        opt.step()
        sched.step()
        values = [g["lr"] for g in opt.param_groups] + [g["momentum"] for g in opt.param_groups]
        out[step] = {k: float(f"{v:.8g}") for k, v in zip(KEYS, values)}
    return out


def test_group_names():
    assert group_names([{"name": "enc"}, {}, {"name": "enc"}, {"name": ""}]) == [
        "enc", "pg1", "enc-2", "pg3"]


def test_plugin_module_does_not_import_torch():
    assert not imports_torch("distrun_lr_monitor.plugin")


def test_two_groups_onecycle_exact_rates_per_step(tmp_path):
    # 8 steps an epoch, 2 epochs, a row every 3 steps: training rows at 3, 6, 9, 12, 15, the
    # last partial window at 16, and an lr row of its own at the end of epoch 0 (step 8)
    result = run_cli("run", "--name", "lr", "--nproc-per-node", "2", "--strategy", "ddp",
                     "--max-epochs", "2", "--batch-size", "32", "--log-every-n-steps", "3",
                     "--lr-monitor", "--lr-monitor-momentum", "--no-summary", "-p", "no:progress", TASK,
                     cwd=tmp_path)
    assert result.returncode == 0, result
    with open(tmp_path / "runs" / "lr" / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    with_lr = [r for r in rows if r["lr-body"]]
    assert [int(r["step"]) for r in with_lr] == [3, 6, 8, 9, 12, 15, 16]
    expected = expected_after_each_step()
    for row in with_lr:
        got = {k: float(row[k]) for k in KEYS}
        assert got == expected[int(row["step"])], row
        if row["loss"]:  # a training row: the core's lr column is the first group's
            assert float(row["lr"]) == got["lr-body"]
    assert sorted({r["epoch"] for r in with_lr if not r["loss"]}) == ["0"]  # the epoch-end row
    # validation rows carry no rates; the rates differ per group (not one copied value)
    assert all(not r["lr-body"] for r in rows if r["val_loss"])
    assert expected[3]["lr-body"] == pytest.approx(5 * expected[3]["lr-pg1"])
    # every logger sees them: the console line too
    line = next(ln for ln in result.stdout.splitlines() if ln.startswith("epoch 0 | step 3 |"))
    assert all(f"| {key} " in line for key in KEYS), line


class HookRecorder:
    """Records which plugins implement distrun_on_step_end while a fit runs."""

    def __init__(self) -> None:
        self.step_end: list[str] = []

    @distrun.hookimpl
    def distrun_on_step_end(self, run, step):
        if step == 1:
            self.step_end = sorted(
                getattr(i.plugin, "__name__", type(i.plugin).__module__)
                for i in run.pm.hook.distrun_on_step_end.get_hookimpls())


def _fit_with_and_without(rank: int, world: int, run_dir: str) -> dict:
    from lr_tasks import TwoGroups

    recorder = HookRecorder()
    out = {}
    for on in (False, True):
        run = distrun.Trainer(plugins=(recorder,), lr_monitor=on, max_steps=4, batch_size=32,
                              summary=False, run_dir=os.path.join(run_dir, str(on))).fit(
            TwoGroups())
        out[on] = {"hooks": recorder.step_end, "metrics": sorted(run.metrics)}
    return out


@pytest.mark.slow
def test_off_registers_no_per_step_hook(tmp_path):
    out = run_on_ranks(_fit_with_and_without, 1, str(tmp_path))[0]
    assert "distrun_lr_monitor.plugin" in out[True]["hooks"]  # on: its hook is there
    assert "lr-body" in out[True]["metrics"]
    assert not any(h.startswith("distrun_lr_monitor") for h in out[False]["hooks"])
    assert "lr-body" not in out[False]["metrics"]
