"""Stages (validate, test, predict), logging from steps and LR schedulers, on real ranks."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from distrun import Trainer, UsageError
from distrun._loggers.csv_file import read_metrics
from distrun.testing import run_cli, run_on_ranks

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from stage_task import N_TEST, StageTask, make_data, reference  # noqa: E402

TASK = str(HERE / "stage_task.py")


def _fit_then_stages(rank, world, run_dir):
    os.environ["STAGE_RANK_VALUE"] = "1"
    task = StageTask()
    trainer = Trainer(max_epochs=2, batch_size=16, summary=False, run_dir=run_dir,
                      log_every_n_steps=4)
    run = trainer.fit(task)
    out = {"test": trainer.test(), "validate": trainer.validate(), "predict": trainer.predict(),
           "reference": reference(run.unwrapped_model()),
           "fit": run.results["fit"]}
    x = make_data(N_TEST, seed=2).tensors[0]
    with torch.no_grad():
        out["expected_predict"] = run.unwrapped_model()(x)
    trainer.close()
    return out


def test_fit_then_test_validate_predict_on_two_ranks_count_every_sample_once(tmp_path):
    results = run_on_ranks(_fit_then_stages, 2, str(tmp_path / "run"), timeout=180)
    for r in results:
        # 63 test samples on 2 ranks in batches of 8: one rank runs a filler batch, which
        # must not count: the metrics equal the whole test set's in one batch
        for name, value in r["reference"].items():
            assert r["test"][name] == pytest.approx(value, rel=1e-6), name
        assert set(r["validate"]) == {"val_loss"}
        assert r["predict"].shape == (N_TEST, 1)  # in dataset order, every sample once
        torch.testing.assert_close(r["predict"], r["expected_predict"], rtol=1e-5, atol=1e-6)
    assert results[0]["test"] == results[1]["test"]
    assert torch.equal(results[0]["predict"], results[1]["predict"])

    rows = read_metrics(str(tmp_path / "run" / "metrics.csv"))
    train = [r for r in rows if "loss" in r]
    assert len(train) == 256 // 16 * 2 // 4  # a row every 4 steps
    for row in train:
        assert row["rank_value"] == pytest.approx(1.5)  # ranks logged 1 and 2
        assert row["count"] == 4 * 2  # summed over the 4 steps of the row and both ranks
        assert row["doubled"] == pytest.approx(2 * row["loss"], rel=1e-6)
    epoch_rows = [r for r in rows if "epoch_value" in r]
    assert [r["step"] for r in epoch_rows] == [16, 32] and epoch_rows[0]["epoch_value"] == 2.0
    test_rows = [r for r in rows if "test_loss" in r]
    assert len(test_rows) == 1
    assert test_rows[0]["test_mae"] == pytest.approx(results[0]["test"]["test_mae"], rel=1e-6)


def test_schedulers_step_per_step_and_on_plateau_and_their_state_is_kept(
        distrun_pm, tmp_path, monkeypatch):
    monkeypatch.setenv("STAGE_PLATEAU", "1")
    trainer = Trainer(max_epochs=3, batch_size=32, summary=False, run_dir=str(tmp_path / "r"))
    run = trainer.fit(StageTask())
    # StepLR: x0.9 every 4 of the 24 steps; the plateau one (val_loss never improves, patience
    # 0) x0.1 after epochs 2 and 3
    assert run.optimizer.param_groups[0]["lr"] == pytest.approx(0.05 * 0.9 ** 6 * 0.1 ** 2)
    states = run.state_dict()["schedulers"]
    assert [s["last_epoch"] for s in states] == [24, 3]
    assert states[1]["num_bad_epochs"] == 0 and states[1]["best"] == 1.0
    trainer.close()


def test_a_plateau_scheduler_without_its_metric_is_a_one_line_error(distrun_pm, tmp_path):
    class NoVal(StageTask):
        def configure_scheduler(self, optimizer):
            return {"scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer),
                    "monitor": "val_acc", "interval": "epoch"}

    with pytest.raises(SystemExit) as info:
        Trainer(max_epochs=1, batch_size=32, summary=False, run_dir=str(tmp_path / "r")).fit(
            NoVal())
    assert info.value.code == 2


def test_a_dict_without_loss_and_a_wrong_logged_value_are_usage_errors(distrun_pm, tmp_path):
    class NoLoss(StageTask):
        def training_step(self, model, batch):
            return {"acc": torch.tensor(1.0)}

    with pytest.raises(UsageError, match="without 'loss'"):
        Trainer(max_steps=1, batch_size=32, summary=False, debug=True,
                run_dir=str(tmp_path / "a")).fit(NoLoss())

    class BadLog(StageTask):
        def training_step(self, model, batch):
            self.log("vec", torch.ones(3))
            return super().training_step(model, batch)

    with pytest.raises(UsageError, match="log one number"):
        Trainer(max_steps=1, batch_size=32, summary=False, debug=True,
                run_dir=str(tmp_path / "b")).fit(BadLog())


@pytest.mark.slow
def test_stage_flag_tests_a_checkpoint_in_new_processes(tmp_path):
    pytest.importorskip("distrun_safetensors", reason="checkpoints need distrun-safetensors")
    fit = run_cli("run", "--nproc-per-node", "2", "--max-epochs", "1", "--batch-size", "16",
                  "--name", "fit", "--ckpt-save-on-end", "--no-summary",
                  f"{TASK}:StageTask", cwd=tmp_path, timeout=240)
    assert fit.returncode == 0, fit
    ckpt = tmp_path / "runs" / "fit"  # a run folder: its newest checkpoint
    result = run_cli("run", "--nproc-per-node", "2", "--stage", "test", "--batch-size", "16",
                     "--resume", str(ckpt.resolve()), "--name", "eval", "--no-summary",
                     f"{TASK}:StageTask", cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result
    rows = read_metrics(str(tmp_path / "runs" / "eval" / "metrics.csv"))
    assert [set(r) >= {"test_loss", "test_mae"} for r in rows] == [True]
    assert rows[0]["step"] == 256 // 16  # the checkpoint's step

    # predictions too large to gather: each rank writes its own, with dataset indices
    pred = run_cli("run", "--nproc-per-node", "2", "--stage", "predict", "--predictions",
                   "write", "--batch-size", "16", "--resume", str(ckpt.resolve()), "--name",
                   "pred", "--no-summary", f"{TASK}:StageTask", cwd=tmp_path, timeout=240)
    assert pred.returncode == 0, pred
    from safetensors.torch import load_file

    parts = [load_file(str(tmp_path / "runs" / "pred" / "predictions" / f"rank-{r}.safetensors"))
             for r in range(2)]
    index = torch.cat([p["index"] for p in parts])
    output = torch.cat([p["output"] for p in parts])
    assert sorted(index.tolist()) == list(range(N_TEST))  # every sample once, fillers out
    assert output.shape == (N_TEST, 1)

    bad = run_cli("run", "--stage", "tset", f"{TASK}:StageTask", cwd=tmp_path)
    assert bad.returncode == 2 and "names no stage tset" in bad.stderr, bad
    assert len(bad.stderr.strip().splitlines()) == 1, bad


def test_scheduler_states_resume_from_a_checkpoint(distrun_pm, tmp_path, monkeypatch):
    pytest.importorskip("distrun_safetensors", reason="checkpoints need distrun-safetensors")
    import distrun_safetensors.plugin as st

    monkeypatch.setenv("STAGE_PLATEAU", "1")

    def fit(run_dir, epochs, **options):
        with Trainer(plugins=(st,), max_epochs=epochs, batch_size=32, summary=False,
                     run_dir=str(tmp_path / run_dir), **options) as trainer:
            run = trainer.fit(StageTask())
            return run.optimizer.param_groups[0]["lr"], run.state_dict()["schedulers"]

    whole = fit("whole", 3)
    fit("cut", 2, ckpt_save_on_end=True)
    resumed = fit("cut", 3, resume="latest")
    assert resumed == whole  # StepLR's count and the plateau's best/bad epochs carried over
