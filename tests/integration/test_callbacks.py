"""Callback objects (``Trainer(callbacks=[...])``) on 2 gloo ranks: two ModelCheckpoint
objects that prune only their own folders, a plain Lightning-style callback whose state is
restored on resume, and EarlyStopping objects that stop at the epoch the scripted val_loss
says. ``cb_task.Scripted`` logs val_loss = SCRIPT[epoch] (5, 3, 4, 1, 2, 6), 2 steps an
epoch, so every decision is known in advance."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from distrun.testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytest.importorskip("distrun_safetensors")
pytest.importorskip("distrun_early_stopping")
pytestmark = pytest.mark.timeout(600)

COMMON = dict(batch_size=4, seed=0, summary=False, log_every_n_steps=1)


def rank_callbacks(rank, world, root):
    from cb_task import Counter, Scripted

    from distrun import Trainer
    from distrun_early_stopping import EarlyStopping
    from distrun_safetensors import ModelCheckpoint

    def checkpoints():
        return [ModelCheckpoint(monitor="val_loss", save_top_k=2),
                ModelCheckpoint(every_n_steps=4)]

    # a cadence of the flag form beside them (steps 6 and 12, all kept): its folders are not
    # the callbacks' to remove
    flags = dict(ckpt_every_n_steps=6, ckpt_keep_last=0, run_dir=f"{root}/mc")
    first = Counter()
    Trainer(callbacks=[*checkpoints(), first], max_epochs=3, **COMMON, **flags).fit(Scripted())
    after_first = sorted(os.listdir(f"{root}/mc/checkpoints"))
    second, mcs = Counter(), checkpoints()
    run = Trainer(callbacks=[*mcs, second], max_epochs=6, resume="latest", **COMMON,
                  **flags).fit(Scripted())
    out = {"after_first": after_first, "resumed_from": os.path.basename(run.resumed_from),
           "loaded": second.loaded, "batches": second.batches, "epochs": second.epochs,
           "seen": second.seen[:3], "val_ends": second.val_ends,
           "best": os.path.basename(mcs[0].best_model_path),
           "top": sorted(os.path.basename(p) for p in mcs[0].best_k_models)}
    stoppers = [EarlyStopping("val_loss", patience=1), EarlyStopping("val_loss", mode="max",
                                                                     patience=10)]
    stopped = Trainer(callbacks=stoppers, max_epochs=6, **COMMON,
                      run_dir=f"{root}/es").fit(Scripted())
    out["es"] = {"epoch": stopped.progress.epoch, "step": stopped.progress.step,
                 "stopped_at": [s.stopped_at for s in stoppers],
                 "best": [s.best for s in stoppers]}
    return out


def test_checkpoint_objects_prune_their_own_a_callback_resumes_and_early_stopping_stops(
        tmp_path):
    results = run_on_ranks(rank_callbacks, 2, str(tmp_path), init_process_group=True,
                           timeout=300)
    r = results[0]
    assert results[1] == r
    # run 1 (epochs 0-2): A (val_loss top 2) wrote step-2, B (every 4 steps) step-4, the
    # cadence step-6 (A holds it for val_loss 4); nothing was let go yet but step-2 (A's, out
    # of its top 2 at step 6, whose save was the cadence's: pruned at the next commit)
    assert r["after_first"] == [".generation", "latest", "step-2", "step-4", "step-6"]
    assert r["resumed_from"] == "step-6"
    # run 2: A ends with val_loss 1 (step 8) and 2 (step 10); B with step 12. step-8 was B's
    # and B let it go, but A keeps it; step-4 was B's and nobody keeps it; step-2 was A's;
    # step-6 (the cadence's) stays although A let it go: not A's to remove
    assert sorted(os.listdir(tmp_path / "mc" / "checkpoints")) == [
        ".generation", "latest", "step-10", "step-12", "step-6", "step-8"]
    assert (r["best"], r["top"]) == ("step-8", ["step-10", "step-8"])
    # the plain callback got its state back and counted on: 12 steps and 6 epochs in all
    assert r["loaded"] == {"batches": 6, "epochs": 2}
    assert (r["batches"], r["epochs"]) == (12, 6)
    assert r["seen"] == [(3, 7, 0), (3, 8, 1), (4, 9, 0)]
    assert r["val_ends"] == [4.0, 1.0, 2.0, 6.0]  # step 6 again (resumed at its end), 8-12
    # EarlyStopping(patience=1): val_loss 4 after 3 at epoch 2 stops there (step 6); the
    # other one (max, patience 10) never stops and keeps its own best
    assert r["es"] == {"epoch": 3, "step": 6, "stopped_at": [6, None], "best": [3.0, 5.0]}
