"""Best-k checkpoints (--ckpt-monitor): which folders stay, the `best` pointer, the manifest's
record, `--ckpt-resume-best`, the top k across a resume, `ckpt ls`, retention rules."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from st_best import BestTask, Probe, rank_best
from st_layouts import build, compare, full_state, train_step

from distrun.testing import run_cli, run_on_ranks
from distrun_safetensors.files import CheckpointError
from distrun_safetensors.load import load
from distrun_safetensors.retention import Retention
from distrun_safetensors.save import Checkpointer


def _manifest(folder) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def test_top_k_on_two_ranks_keep_last_resume_and_resume_best(tmp_path):
    """val_loss 0.9 0.7 0.5 0.3 0.4 0.6 0.8 1.0 over steps 1-8, K=2, keep_last=1, a cadence
    save every 3 steps and one at the end: steps 4 and 5 stay (the best), step 8 (the last),
    nothing else; `best` names step-4; the same after a resume at step 5."""
    results = run_on_ranks(rank_best, 2, str(tmp_path), init_process_group=True, timeout=240)
    for name in ("a", "c"):
        ckpts = tmp_path / name / "checkpoints"
        assert sorted(os.listdir(ckpts)) == [".generation", "best", "latest", "step-4", "step-5",
                                            "step-8"], name
        assert (ckpts / "best").read_text() == "step-4\n"
        assert (ckpts / "latest").read_text() == "step-8\n"
        records = {s: _manifest(ckpts / f"step-{s}").get("monitor") for s in (4, 5, 8)}
        assert records[4]["name"] == "val_loss" and records[4]["mode"] == "min"
        assert records[4]["value"] == pytest.approx(0.3) and records[4]["step"] == 4
        assert records[5]["value"] == pytest.approx(0.4) and records[8] is None
        assert _manifest(ckpts / "step-4")["reason"] == "best"
        assert _manifest(ckpts / "step-8")["reason"] == "end"
    # C stopped at step 5: steps 1 and 2 had left the top 2, step 3 (a cadence save that was
    # among the best, then fell out) was still the newest regular one for keep_last=1
    assert results[0]["listing_c5"] == [".generation", "best", "latest", "step-3", "step-4",
                                          "step-5"]
    # B started from A's best (step 4) with the weights A had after step 4, bit for bit
    for r in results:
        assert r["resumed_from"] == str(tmp_path / "a" / "checkpoints" / "step-4")
        assert r["best_weights_equal"] and all(r["best_weights_equal"].values())
    from distrun_safetensors import load_checkpoint

    model = BestTask().configure_model()
    load_checkpoint("best", model, ckpt_dir=str(tmp_path / "a" / "checkpoints"))
    assert all(torch.equal(v, results[0]["weights4"][k]) for k, v in model.state_dict().items())

    listing = run_cli("ckpt", "ls", str(tmp_path / "a"))
    assert listing.returncode == 0, listing
    lines = {line[2:].split()[0]: line for line in listing.stdout.splitlines()
             if line[2:7] == "step-"}
    assert "val_loss=0.3 #1 of top 2  <- best" in lines["step-4"], listing.stdout
    assert "val_loss=0.4 #2 of top 2" in lines["step-5"] and "best" not in lines["step-8"]
    assert lines["step-8"].startswith("* step-8")
    shown = run_cli("ckpt", "inspect", str(tmp_path / "a" / "checkpoints" / "step-5"))
    assert "monitored val_loss=0.4 (min, logged at step 5)" in shown.stdout, shown


def test_missing_metric_warns_once_naming_the_metrics(tmp_path, caplog):
    import st_plugin

    from distrun import Trainer

    with caplog.at_level(logging.WARNING, logger="distrun"):
        Trainer(plugins=(st_plugin, Probe()), strategy="single", batch_size=8, max_steps=3,
                val_every_n_steps=1, log_every_n_steps=1, summary=False,
                run_dir=str(tmp_path / "r"), ckpt_monitor="val_acc").fit(BestTask())
    said = [r.getMessage() for r in caplog.records if "--ckpt-monitor" in r.getMessage()]
    assert len(said) == 1, said
    assert "val_acc: no such metric was logged" in said[0] and "val_loss" in said[0] \
        and "loss" in said[0], said[0]
    assert not (tmp_path / "r" / "checkpoints" / "best").exists()


def test_max_mode_train_metric_and_a_tag_of_a_step_already_saved(tmp_path):
    """mode max on a train metric (lr: the schedule only lowers it, and a tie never enters a
    full list, so step 1 stays the best); a best at a step the cadence saved already adds the
    record to that folder's manifest instead of writing it again."""
    import st_plugin

    from distrun import Trainer

    run = Trainer(plugins=(st_plugin, Probe()), strategy="single", batch_size=8, max_steps=4,
                  log_every_n_steps=1, summary=False, run_dir=str(tmp_path / "r"),
                  ckpt_monitor="lr", ckpt_mode="max", ckpt_save_top_k=1,
                  ckpt_every_n_steps=1, ckpt_keep_last=1).fit(BestTask())
    ckpts = tmp_path / "r" / "checkpoints"
    best = (ckpts / "best").read_text().strip()
    record = _manifest(ckpts / best)["monitor"]
    assert record["name"] == "lr" and record["mode"] == "max" and record["top_k"] == 1
    # the cadence save of that step holds the record: not a folder saved for "best"
    assert _manifest(ckpts / best)["reason"] == "step"
    assert sorted(os.listdir(ckpts)) == sorted({".generation", "best", "latest", best, "step-4"})
    assert run.progress.step == 4


def _save(saver, step, model, opt, reason="step", record=None, retention=None):
    train_step(model, opt, step)
    path = saver.save(step, model, opt, {"progress": {"step": step}}, reason=reason,
                      record=record, retention=retention)
    saver.wait()
    return path


def test_retention_rules_and_best_fallback(tmp_path, caplog):
    """keep_last counts the regular checkpoints only; best-only ones of the monitored metric
    go when they leave the top k; another metric's are never touched; a run without a monitor
    leaves every checkpoint carrying a value alone; `best` falls back to the best valid one."""
    d = tmp_path / "ckpt"
    model, opt = build("plain")
    saver = Checkpointer(str(d), keep_last=1)

    def ret(*names, best=None):
        return Retention(best=best or (names[0] if names else None), protect=frozenset(names),
                         monitor="val_loss", mode="min")

    def rec(value, step, name="val_loss"):
        return {"name": name, "mode": "min", "value": value, "step": step, "top_k": 2}

    _save(saver, 1, model, opt, "best", rec(0.5, 1, "other"))  # another metric's best
    _save(saver, 2, model, opt, "best", rec(0.4, 2), ret("step-2"))
    _save(saver, 3, model, opt, "best", rec(0.3, 3), ret("step-3", "step-2"))
    _save(saver, 4, model, opt, "step", None, ret("step-3", "step-2"))
    _save(saver, 5, model, opt, "step", None, ret("step-3", "step-2"))
    assert sorted(os.listdir(d)) == [".generation", "best", "latest", "step-1", "step-2", "step-3",
                                 "step-5"]
    assert (d / "best").read_text() == "step-3\n"
    _save(saver, 6, model, opt, "best", rec(0.1, 6), ret("step-6", "step-3"))
    assert sorted(os.listdir(d)) == [".generation", "best", "latest", "step-1", "step-3", "step-5",
                                 "step-6"]
    assert (d / "best").read_text() == "step-6\n"

    # a run without --ckpt-monitor: keep_last=1 leaves the folders carrying a value alone
    plain = Checkpointer(str(d), keep_last=1)
    _save(plain, 7, model, opt)
    assert sorted(os.listdir(d)) == [".generation", "best", "latest", "step-1", "step-3", "step-6",
                                 "step-7"]

    # `best` follows the pointer; a damaged target falls back to the next best value
    fresh, fresh_opt = build("plain", seed=9)
    assert load("best", fresh, fresh_opt, ckpt_dir=str(d)).step == 6
    os.truncate(d / "step-6" / "model-00001-of-00001.safetensors", 10)
    with caplog.at_level(logging.WARNING, logger="distrun"):
        result = load("latest", fresh, fresh_opt, ckpt_dir=str(d), pointer="best")
    assert result.step == 3
    assert any("skipping" in r.getMessage() and "step-6" in r.getMessage()
               for r in caplog.records)
    ref, ref_opt = build("plain")
    for step in (1, 2, 3):
        train_step(ref, ref_opt, step)
    assert compare(full_state(fresh, fresh_opt), full_state(ref, ref_opt)) == []
    (d / "best").write_text("garbage\n")
    assert load("best", fresh, fresh_opt, ckpt_dir=str(d)).step == 3
    # no checkpoint carries a value: one clear error for best, nothing for auto
    empty = tmp_path / "empty"
    Checkpointer(str(empty)).save(1, model, opt, {})
    with pytest.raises(CheckpointError, match="no best checkpoint in .*--ckpt-monitor"):
        load("best", fresh, fresh_opt, ckpt_dir=str(empty))
    assert load("auto", fresh, fresh_opt, ckpt_dir=str(empty), pointer="best") is None


def _best_save_and_maybe_die(directory: str, kill_at: int, tag: bool) -> None:
    from st_plugin import kill_at as kill_at_point

    kill_at_point(kill_at)
    model, opt = build("plain", seed=2)
    train_step(model, opt, 2)
    saver = Checkpointer(directory, keep_last=1)
    record = {"name": "val_loss", "mode": "min", "value": 0.3, "step": 2, "top_k": 1}
    new = Retention(best="step-2", protect=frozenset({"step-2"}), monitor="val_loss",
                    mode="min")
    if tag:  # a cadence save of step 2, then its validation makes it the best
        old = Retention(best="step-1", protect=frozenset({"step-1"}), monitor="val_loss",
                        mode="min")
        saver.save(2, model, opt, {"progress": {"step": 2}}, reason="step", retention=old)
    saver.save(2, model, opt, {"progress": {"step": 2}}, reason="best", record=record,
               retention=new)
    saver.wait()
    os._exit(0)


@pytest.mark.parametrize("tag", [False, True], ids=["best_save", "tag_of_a_cadence_save"])
def test_kill_at_every_point_of_a_best_save_leaves_best_loadable(tmp_path, tag):
    """K=1: step 1 is the best, a better step 2 comes; a kill -9 at any durable point leaves
    `best` loading a complete checkpoint with a value (step 1 or step 2, never half of one)."""
    import multiprocessing as mp
    import shutil
    import signal

    from distrun_safetensors.manifest import monitor_record, read_manifest_quietly

    pristine = str(tmp_path / "pristine")
    model, opt = build("plain", seed=1)
    train_step(model, opt, 1)
    saver = Checkpointer(pristine, keep_last=1)
    saver.save(
        1, model, opt, {"progress": {"step": 1}}, reason="best",
        record={"name": "val_loss", "mode": "min", "value": 0.5, "step": 1, "top_k": 1},
        retention=Retention(best="step-1", protect=frozenset({"step-1"}), monitor="val_loss",
                            mode="min"))
    saver.wait()  # its pruning too: nothing of the save is still changing when it is copied
    loaded = []
    for k in range(1, 60):
        directory = str(tmp_path / f"k{k}")
        shutil.copytree(pristine, directory)
        child = mp.get_context("fork").Process(target=_best_save_and_maybe_die,
                                               args=(directory, k, tag))
        child.start()
        child.join(120)
        assert child.exitcode in (0, -signal.SIGKILL), child.exitcode
        fresh, fresh_opt = build("plain", seed=99)
        result = load("best", fresh, fresh_opt, ckpt_dir=directory)
        assert monitor_record(read_manifest_quietly(result.path)) is not None, (k, result.path)
        ref, ref_opt = build("plain", seed=result.step)
        train_step(ref, ref_opt, result.step)
        assert compare(full_state(fresh, fresh_opt), full_state(ref, ref_opt)) == [], k
        loaded.append(result.step)
        if child.exitcode == 0:
            break
    else:
        raise AssertionError("the save never completed without a kill")
    assert len(loaded) >= 10 and loaded[0] == 1 and loaded[-1] == 2, loaded
    assert sorted(os.listdir(directory)) == [".generation", "best", "latest", "step-2"]
