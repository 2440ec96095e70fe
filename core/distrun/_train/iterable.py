"""Training on an ``IterableDataset``: sharded by distrun, batched, and resumable mid-epoch.

A map-style dataset has the data cursor of :mod:`distrun._train.sampler`. A stream has no
index, so:

- :class:`ShardedStream` deals its items round-robin to the ``dp_world x num_workers``
  shards (data-parallel rank, then DataLoader worker) and drops a last round that cannot feed
  every shard, so every rank gets the same number of items and no rank waits for another at
  the end of the epoch (each reads the whole stream: a source that can shard itself, such as
  files per rank, should do so and be returned as a DataLoader);
- the DataLoader is torchdata's ``StatefulDataLoader``, whose ``state_dict()`` says where the
  stream is (per worker); the stream's iterator keeps its own position, so a resume skips
  the items already trained on without torchdata's naive fast-forward of whole batches;
- the loop records the loader's state *before* it reads ahead (it looks one batch ahead to
  find the epoch's last micro-batch), so a checkpoint holds the position after the last
  batch trained on, not the one fetched.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from distrun._spec.errors import UsageError
from distrun._train.sampler import local_batch_size

__all__ = ["ShardedStream", "StreamCursor", "stream_loader"]


class ShardedStream(torch.utils.data.IterableDataset):
    """This rank's share of ``data`` (and, inside a DataLoader worker, that worker's)."""

    def __init__(self, data: Iterable[Any], dp_rank: int, dp_world: int) -> None:
        self.data = data
        self.dp_rank = dp_rank
        self.dp_world = dp_world

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.data, "set_epoch"):
            self.data.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        info = torch.utils.data.get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        return _ShardIterator(self.data, self.dp_world * workers, self.dp_rank * workers + worker)


class _ShardIterator:
    """Every ``shards``-th item from ``mine``, whole rounds only; its state is the number of
    source items read, so a resume skips them without yielding them again."""

    def __init__(self, data: Iterable[Any], shards: int, mine: int) -> None:
        self.data = data
        self.shards = shards
        self.mine = mine
        self.read = 0
        self._it: Iterator[Any] | None = None

    def __iter__(self) -> _ShardIterator:
        return self

    def __next__(self) -> Any:
        if self._it is None:
            self._it = iter(self.data)
            for _ in range(self.read):  # resuming: the source items before the position
                next(self._it)
        ours = None
        for pos in range(self.shards):  # one round: an item for every shard
            item = next(self._it)  # StopIteration mid-round drops the round
            self.read += 1
            if pos == self.mine:
                ours = item
        return ours

    def state_dict(self) -> dict[str, int]:
        return {"read": self.read, "shards": self.shards}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if int(state["shards"]) != self.shards:
            raise UsageError(
                f"the checkpoint's stream position is for {state['shards']} shards (ranks x "
                f"DataLoader workers) but this run has {self.shards}: resume an IterableDataset "
                "with the same --nproc-per-node and --num-workers (or --resume never)")
        self.read = int(state["read"])
        self._it = None


def stream_loader(data: Any, batch_size: int, dp_rank: int, dp_world: int,
                  **common: Any) -> Any:
    """A resumable loader of this rank's batches of ``batch_size // dp_world`` items."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:  # pragma: no cover - a dependency of distrun
        raise UsageError("an IterableDataset needs torchdata: pip install torchdata") from None
    local = local_batch_size(batch_size, dp_world)
    common.pop("generator", None)  # a stream has no sampler to seed
    if common.get("num_workers", 0) == 0:
        common.pop("persistent_workers", None)
    return StatefulDataLoader(ShardedStream(data, dp_rank, dp_world),
                              batch_size=local, drop_last=True, **common)


class StreamCursor:
    """Iterates a stateful loader, keeping the state after each batch it hands out (taken
    before the next batch is read ahead)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.state: dict[str, Any] | None = None

    def with_last(self) -> Iterator[tuple[Any, bool]]:
        it = iter(self.loader)
        try:
            prev = next(it)
        except StopIteration:
            return
        while True:
            state = self.loader.state_dict()
            try:
                item = next(it)
            except StopIteration:
                self.state = state
                yield prev, True
                return
            self.state = state
            yield prev, False
            prev = item
