"""A run's state in three kinds (fixed for the session, built in setup, changed by the loop),
and sessions carried by the objects the user holds, not by module globals."""

from __future__ import annotations

import dataclasses
import gc
import sys
import weakref
from pathlib import Path

import pytest

import distrun
from distrun import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from stage_task import StageTask  # noqa: E402


def test_what_is_fixed_for_the_session_is_frozen_and_the_loop_state_is_apart(
        distrun_pm, tmp_path):
    trainer = Trainer(max_epochs=1, batch_size=32, summary=False, run_dir=str(tmp_path / "r"),
                      plugin_manager=distrun_pm)
    run = trainer.fit(task := StageTask())
    try:
        assert (run.config, run.task, run.pm) == (run.fixed.config, task, distrun_pm)
        assert run.run_dir == str(tmp_path / "r") and run.hook is distrun_pm.hook
        with pytest.raises(dataclasses.FrozenInstanceError):
            run.fixed.config = None  # type: ignore[misc]
        with pytest.raises(AttributeError):
            run.config = None  # type: ignore[misc]
        assert run.progress is run.state.progress and run.progress.step == 8
        assert run.metrics is run.state.metrics and "loss" in run.metrics
        run.done = False  # a plugin may still set what the loop reads
        assert run.state.done is False
    finally:
        trainer.close()


def test_module_level_calls_reuse_the_live_model_and_keep_no_task_alive(
        distrun_pm, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = StageTask()
    run = distrun.fit(first, max_epochs=1, batch_size=32, summary=False, run_dir="a")
    trained = run.unwrapped_model()
    # validate() of the same task object runs on the model fit() trained, in the same session
    assert distrun.validate(first)["val_loss"] == distrun.validate(first)["val_loss"]
    assert distrun._trainer(first, {})._session(first).unwrapped_model() is trained
    del run, trained
    # another session closes the first one; nothing of the first task stays reachable from
    # distrun (a module global used to hold the last task, its trainer and model)
    gone = weakref.ref(first)
    other = Trainer(max_epochs=1, batch_size=32, summary=False, run_dir=str(tmp_path / "b"))
    other.fit(StageTask())
    del first
    gc.collect()
    try:
        assert gone() is None, gc.get_referrers(gone())
    finally:
        other.close()
