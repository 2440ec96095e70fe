"""What a LightningModule reaches for, on 2 gloo ranks in one launch: the trainer, epoch,
step and batch index from the task; save_hyperparameters; a checkpoint of the last step by
default; limit_train_batches, overfit_batches, fast_dev_run and drop_last; the sanity
validation pass; a DataModule; activation checkpointing; --deterministic."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from distrun.testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytest.importorskip("distrun_safetensors")
pytestmark = pytest.mark.timeout(600)

COMMON = dict(batch_size=4, seed=0, summary=False)


def _weights(run):
    return {k: v.detach().clone() for k, v in run.unwrapped_model().state_dict().items()}


def rank_conveniences(rank, world, root):
    from lm_task import Recording

    from distrun import Trainer
    from distrun_safetensors import load_checkpoint

    out = {}
    # the defaults: 2 epochs of 4 steps, a sanity pass of 2 batches, the last step saved
    task = Recording(lr=0.1, hidden=6)
    run = Trainer(max_epochs=2, run_dir=f"{root}/plain", **COMMON).fit(task)
    out["steps"] = [s[:3] for s in task.steps]
    out["same_trainer"] = task.same_trainer
    out["val_calls"] = task.val_calls
    out["ckpts"] = sorted(os.listdir(f"{root}/plain/checkpoints"))
    loaded = load_checkpoint(f"{root}/plain/checkpoints/step-8",
                             Recording(hidden=6).configure_model())
    out["ckpt_hparams"] = loaded.state.get("hparams")
    out["hparams"] = task.hparams
    plain = _weights(run)
    # the sanity pass leaves the random state as it was: the same weights without it
    quiet = Recording(lr=0.1, hidden=6)
    run = Trainer(max_epochs=2, run_dir=f"{root}/nosanity", num_sanity_val_steps=0,
                  ckpt_save_on_end=False, **COMMON).fit(quiet)
    out["nosanity_val_calls"] = quiet.val_calls
    out["same_weights"] = all(torch.equal(v, _weights(run)[k]) for k, v in plain.items())
    out["nosanity_ckpts"] = os.path.exists(f"{root}/nosanity/checkpoints")
    # limit_train_batches: 3 micro-batches an epoch
    limited = Recording()
    Trainer(max_epochs=2, run_dir=f"{root}/limit", limit_train_batches=3, limit_val_batches=1,
            num_sanity_val_steps=0, **COMMON).fit(limited)
    out["limit_steps"] = [s[:3] for s in limited.steps]
    out["limit_val_calls"] = limited.val_calls
    # overfit_batches: the same 2 batches, unshuffled, every epoch; validated on them
    over = Recording()
    Trainer(max_epochs=3, run_dir=f"{root}/overfit", overfit_batches=2, num_sanity_val_steps=0,
            **COMMON).fit(over)
    out["overfit_samples"] = [s[3] for s in over.steps]
    out["overfit_val_calls"] = over.val_calls
    # fast_dev_run: 2 steps of one epoch, 2 validation batches, no checkpoint
    fast = Recording()
    Trainer(max_epochs=5, run_dir=f"{root}/fast", fast_dev_run=2, **COMMON).fit(fast)
    out["fast_steps"] = [s[:3] for s in fast.steps]
    out["fast_val_calls"] = fast.val_calls
    out["fast_ckpts"] = os.path.exists(f"{root}/fast/checkpoints")
    # drop_last: 16 samples in global batches of 6 drop the tail of 4 by default; without it
    # the tail is trained, filled up with the epoch's first 2 samples
    for drop in (True, False):
        task = Recording()
        Trainer(max_epochs=1, run_dir=f"{root}/drop{int(drop)}", drop_last=drop,
                num_sanity_val_steps=0, ckpt_save_on_end=False,
                **{**COMMON, "batch_size": 6}).fit(task)
        out[f"drop_last={drop}"] = [s[3] for s in task.steps]
    # a DataModule two tasks share: its data wins over the tasks'; prepare_data once a node
    from lm_task import Shared

    shared, first, second = Shared(), Recording(), Recording()
    for i, t in enumerate((first, second)):
        Trainer(max_epochs=1, run_dir=f"{root}/dm{i}", num_sanity_val_steps=0,
                ckpt_save_on_end=False, **COMMON).fit(t, datamodule=shared)
    out["dm"] = {"prepared": shared.prepared, "stages": shared.stages,
                 "samples": [sorted(i for s in t.steps for i in s[3]) for t in (first, second)],
                 "val_calls": [len(t.val_calls) for t in (first, second)]}
    # activation checkpointing: the block runs again in each backward, and trains the same
    from lm_task import Block, Blocky

    ac = {}
    for names in ("", "Block"):
        Block.calls = 0
        run = Trainer(max_epochs=1, run_dir=f"{root}/ac{names}", activation_checkpointing=names,
                      num_sanity_val_steps=0, ckpt_save_on_end=False, **COMMON).fit(Blocky())
        ac[names] = (Block.calls, _weights(run))
    out["ac_calls"] = [ac[""][0], ac["Block"][0]]
    out["ac_same"] = all(torch.equal(v, ac["Block"][1][k]) for k, v in ac[""][1].items())
    out["ac_keys"] = sorted(ac["Block"][1]) == sorted(ac[""][1])
    # --deterministic (process-wide in torch: the last of these runs)
    det = Recording()
    Trainer(max_epochs=1, run_dir=f"{root}/det", deterministic=True, num_sanity_val_steps=0,
            ckpt_save_on_end=False, **COMMON).fit(det)
    out["deterministic"] = (task.deterministic[0], det.deterministic[0])
    return out


def test_what_a_lightning_module_reaches_for(tmp_path):
    results = run_on_ranks(rank_conveniences, 2, str(tmp_path), init_process_group=True,
                           timeout=300)
    r = results[0]
    # (epoch, global_step, batch_idx) at each training_step: the step is the one being made
    assert r["steps"] == [(e, e * 4 + i, i) for e in (0, 1) for i in range(4)]
    assert r["same_trainer"]
    # 16 validation samples on 2 ranks at 2 a batch: 4 batches a rank; 2 of them first (the
    # sanity pass, at step 0), then after each epoch
    assert r["val_calls"] == [0, 0] + [4] * 4 + [8] * 4
    assert r["nosanity_val_calls"] == [4] * 4 + [8] * 4
    assert r["same_weights"]  # dropout drew the same masks with and without the sanity pass
    # the last step is saved by default; --no-ckpt-save-on-end saves none
    assert r["ckpts"] == [".generation", "latest", "step-8"]
    assert r["nosanity_ckpts"] is False
    # save_hyperparameters: every __init__ argument, in hparams.json and in the checkpoint
    want = {"lr": 0.1, "hidden": 6, "broken_val": False}
    assert r["hparams"] == want and r["ckpt_hparams"] == want
    assert json.loads((tmp_path / "plain" / "hparams.json").read_text()) == want
    assert r["limit_steps"] == [(e, e * 3 + i, i) for e in (0, 1) for i in range(3)]
    assert r["limit_val_calls"] == [3, 6]
    # overfit_batches=2: global batches 0-3 and 4-7 of the data, in order, every epoch; this
    # rank (0) holds the first half of each
    assert r["overfit_samples"] == [[0, 1], [4, 5]] * 3
    assert results[1]["overfit_samples"] == [[2, 3], [6, 7]] * 3
    assert r["overfit_val_calls"] == [2, 2, 4, 4, 6, 6]  # 8 samples: 2 batches of 2 a rank
    assert r["fast_steps"] == [(0, 0, 0), (0, 1, 1)]
    assert r["fast_val_calls"] == [2, 2] and r["fast_ckpts"] is False
    kept = {k: [r[k], results[1][k]] for k in ("drop_last=True", "drop_last=False")}
    assert [len(steps) for steps in kept["drop_last=True"]] == [2, 2]
    assert [len(steps) for steps in kept["drop_last=False"]] == [3, 3]
    seen = [i for steps in kept["drop_last=False"] for batch in steps for i in batch]
    assert len(seen) == 18 and sorted(set(seen)) == list(range(16))
    # rank 0 of 2 on one node: prepare_data there only, setup everywhere; the shared data
    # (8 samples from 100, 2 steps) and its 4 validation samples (1 batch a rank)
    assert [x["dm"]["prepared"] for x in results] == [2, 0]
    assert [x["dm"]["stages"] for x in results] == [["fit", "fit"]] * 2
    assert [x["dm"]["val_calls"] for x in results] == [[1, 1]] * 2
    mine = [set(x["dm"]["samples"][0]) for x in results]
    assert mine[0] | mine[1] == set(range(100, 108)) and not mine[0] & mine[1]
    # 4 steps and 4 validation batches: 8 forwards; with it, 4 more in the backward passes
    assert r["ac_calls"] == [8, 12] and r["ac_same"] and r["ac_keys"]
    assert r["deterministic"] == (False, True)


def rank_broken_validation(rank, world, root):
    from lm_task import Recording

    from distrun import Trainer

    task = Recording(broken_val=True)
    try:
        Trainer(max_epochs=1, run_dir=f"{root}/broken", debug=True, **COMMON).fit(task)
    except ValueError as exc:
        return str(exc), len(task.steps)
    return None, len(task.steps)


@pytest.mark.slow
def test_the_sanity_pass_fails_a_broken_validation_step_before_training(tmp_path):
    results = run_on_ranks(rank_broken_validation, 2, str(tmp_path), init_process_group=True,
                           timeout=300)
    assert results == [("validation_step is broken", 0)] * 2
