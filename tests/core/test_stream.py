"""An IterableDataset: sharded over ranks and workers by distrun, and resumed mid-epoch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import distrun
from distrun import Trainer
from distrun.testing import run_on_ranks

N = 203  # not a multiple of ranks x workers: the last, partial round is dropped


class Numbers(torch.utils.data.IterableDataset):
    """Sample i is (i, features of i); no length, no index."""

    def __iter__(self):
        for i in range(N):
            g = torch.Generator().manual_seed(i)
            yield torch.tensor(float(i)), torch.randn(4, generator=g)


class StreamTask(distrun.Task):
    def __init__(self) -> None:
        self.seen: list[list[int]] = []

    def configure_model(self):
        return nn.Linear(4, 1)

    def train_data(self):
        return Numbers()

    def training_step(self, model, batch):
        ids, x = batch
        self.seen.append([int(i) for i in ids])
        return model(x).pow(2).mean()


def _train(rank, world, run_dir, workers, steps, resume):
    task = StreamTask()
    opts = dict(run_dir=run_dir, batch_size=8, num_workers=workers, summary=False,
                max_epochs=2, max_steps=steps, resume="auto" if resume else "never")
    if not resume:
        opts["ckpt_save_on_end"] = True
    with Trainer(**opts) as trainer:
        run = trainer.fit(task)
        return task.seen, run.progress.step, run.progress.epoch


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_a_stream_is_sharded_and_resumes_at_the_item_after_the_last_trained(tmp_path, workers):
    pytest.importorskip("distrun_safetensors", reason="resuming needs distrun-safetensors")
    full = run_on_ranks(_train, 2, str(tmp_path / "full"), workers, -1, False, timeout=180)
    shards = 2 * max(1, workers)  # ranks x workers
    per_epoch = (N // shards) // 4 * 4 * shards  # whole rounds, then whole local batches of 4
    first_epoch = [i for r in full for s in r[0][:len(r[0]) // 2] for i in s]
    assert len(set(first_epoch)) == len(first_epoch) == per_epoch  # each item once
    assert full[0][1] == full[1][1] and full[0][2] == 2  # equal step counts, no hang

    half = run_on_ranks(_train, 2, str(tmp_path / "resumed"), workers, 7, False, timeout=180)
    rest = run_on_ranks(_train, 2, str(tmp_path / "resumed"), workers, -1, True, timeout=180)
    for rank in range(2):
        assert half[rank][0] + rest[rank][0] == full[rank][0], rank  # the same items, in order
        assert rest[rank][1] == full[rank][1]


def _train_in_users_group(rank, world, run_dir):
    import os

    # a group the user made, with torchrun's variables gone (as after init_method="tcp://...")
    os.environ.pop("MASTER_ADDR")
    os.environ.pop("MASTER_PORT")
    return _train(rank, world, run_dir, 0, -1, False)


def test_a_stream_in_a_group_made_without_torchruns_variables_ends_its_epochs(tmp_path):
    """At each epoch's end the ranks of a plain iterable meet in the group's store: found
    without MASTER_ADDR/MASTER_PORT too."""
    got = run_on_ranks(_train_in_users_group, 2, str(tmp_path / "run"), init_process_group=True,
                       timeout=180)
    want = run_on_ranks(_train, 2, str(tmp_path / "ref"), 0, -1, False, timeout=180)
    assert [(step, epoch) for _, step, epoch in got] == [(s, e) for _, s, e in want]
    assert [seen for seen, _, _ in got] == [seen for seen, _, _ in want]
