"""Best-k checkpoints on real ranks: a task whose val_loss is a fixed function of the step
(down to step 4, then up), and the rank functions the tests spawn."""

from __future__ import annotations

import os

import st_plugin
import torch
from st_task import Task

import distrun

#: val_loss after each step: down, then up (K=2 best: steps 4 and 5)
VALS = {1: 0.9, 2: 0.7, 3: 0.5, 4: 0.3, 5: 0.4, 6: 0.6, 7: 0.8, 8: 1.0}

COMMON = dict(strategy="st_ddp", batch_size=8, seed=3, max_epochs=1, log_every_n_steps=100,
              val_every_n_steps=1, summary=False, ckpt_monitor="val_loss", ckpt_save_top_k=2,
              ckpt_keep_last=1, ckpt_every_n_steps=3, ckpt_save_on_end=True)


class BestTask(Task):
    """st_task's model and data; validation reports VALS[step] whatever the weights."""

    step = 0

    def val_data(self):
        return torch.utils.data.TensorDataset(torch.zeros(4, 6), torch.zeros(4, 1))

    def validation_step(self, model, batch):
        return torch.tensor(VALS.get(self.step, 9.0), dtype=torch.float64)


def _weights(run):
    return {k: v.detach().clone() for k, v in run.unwrapped_model().state_dict().items()}


class Probe:
    """Tells the task its step; keeps the weights after every step and at the fit start."""

    def __init__(self) -> None:
        self.after: dict[int, dict[str, torch.Tensor]] = {}
        self.start: dict[str, torch.Tensor] = {}

    @distrun.hookimpl
    def distrun_on_fit_start(self, run):
        run.task.step = run.progress.step
        self.start = _weights(run)

    @distrun.hookimpl
    def distrun_on_step_end(self, run, step):
        run.task.step = step
        self.after[step] = _weights(run)


def _fit(probe: Probe | None = None, **options):
    plugins = (st_plugin,) if probe is None else (st_plugin, probe)
    return distrun.Trainer(plugins=plugins, **{**COMMON, **options}).fit(BestTask())


def rank_best(rank: int, world: int, root: str) -> dict:
    """A: 8 steps straight. C: 5 steps, then resumed to 8 (the top k read back from disk).
    B: a new run started from A's best checkpoint (--ckpt-resume-best on A's folder)."""
    straight = Probe()
    _fit(straight, run_dir=f"{root}/a", max_steps=8)
    # every fit gets a Probe: the task's val_loss follows the step only through it (a plugin
    # given to one Trainer is not in the next one's)
    _fit(Probe(), run_dir=f"{root}/c", max_steps=5)
    listing_c5 = sorted(os.listdir(f"{root}/c/checkpoints"))
    _fit(Probe(), run_dir=f"{root}/c", max_steps=8, resume="latest")
    from_best = Probe()
    resumed = _fit(from_best, run_dir=f"{root}/b", max_steps=5,
                   resume=f"{root}/a/checkpoints", ckpt_resume_best=True)
    same = {k: torch.equal(v, straight.after[4][k]) for k, v in from_best.start.items()}
    return {"listing_c5": listing_c5, "resumed_from": resumed.resumed_from,
            "best_weights_equal": same, "weights4": straight.after[4]}
