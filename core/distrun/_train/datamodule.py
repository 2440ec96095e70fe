"""``DataModule``: data that several tasks share (Lightning's ``LightningDataModule``).

``trainer.fit(task, datamodule=dm)`` (and ``validate``/``test``/``predict``) reads each data
method from ``dm`` when it has it, else from the task. Before the loaders are built,
``prepare_data()`` runs once per node (local rank 0: downloads, caches), every rank waits for
it, then ``setup(stage)`` runs on every rank.
"""

from __future__ import annotations

import os
from typing import Any

from distrun._spec.stash import StashKey

__all__ = ["DataModule", "data_of", "prepare"]

#: the datamodule whose prepare_data and setup ran in this session
_READY: StashKey[Any] = StashKey("datamodule.ready")

#: each data method, and Lightning's name for what returns the same data as a loader
_LIGHTNING = {"train_data": "train_dataloader", "val_data": "val_dataloader",
              "test_data": "test_dataloader", "predict_data": "predict_dataloader"}


class DataModule:
    """Override what you need; a plain object with these names works too. Return Datasets
    (distrun shards and resumes them); Lightning's ``train_dataloader()`` ... are read when
    the ``*_data`` method is missing (a loader is used as it is on every rank)."""

    def prepare_data(self) -> None:
        """Once per node, before ``setup``: download or cache (no state on ``self``: the
        other ranks do not run it)."""

    def setup(self, stage: str) -> None:
        """On every rank, once the node's ``prepare_data`` finished: build the datasets."""

    def train_data(self) -> Any:
        return None

    def val_data(self) -> Any:
        return None

    def test_data(self) -> Any:
        return None

    def predict_data(self) -> Any:
        return self.test_data()


def _method(source: Any, name: str) -> Any:
    fn = getattr(source, name, None)
    if fn is None and name in _LIGHTNING:
        fn = getattr(source, _LIGHTNING[name], None)
    return fn


def data_of(run: Any, name: str) -> Any:
    """What ``name`` (``train_data``, ``val_data``, ``collate_fn`` ...) of the run's
    datamodule gives, else the task's; None when neither has it."""
    for source in (run.datamodule, run.task):
        if source is None:
            continue
        fn = _method(source, name)
        if fn is not None:
            return fn if name == "collate_fn" else fn()
    return None


def prepare(run: Any) -> None:
    """``prepare_data`` on each node's local rank 0, a barrier, then ``setup(stage)``; once
    per session."""
    dm = run.datamodule
    if dm is None or run.stash.get(_READY) is dm:
        return
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and hasattr(dm, "prepare_data"):
        dm.prepare_data()
    import torch.distributed as dist

    if run.world_size > 1 and dist.is_available() and dist.is_initialized():
        dist.barrier()
    if hasattr(dm, "setup"):
        dm.setup(run.stage)
    run.stash[_READY] = dm
