"""The data cursor: a resumable, world-size-agnostic distributed batch sampler.

The order of an epoch is a permutation drawn from ``(seed, epoch)`` over the whole dataset.
Global batches of ``batch_size`` samples are cut from it in order; data-parallel rank ``r`` of
``W`` takes the ``r``-th contiguous ``batch_size / W`` of each. Progress is one number, the
global sample cursor within the epoch, so a resume at any world size continues from the same
global sample, and the mean gradient of a step is the same at every world size.
The tail of an epoch that does not fill a global batch is skipped (``drop_last``), or, with
``drop_last=False``, filled up with the epoch's first samples and trained (as torch's
``DistributedSampler`` pads).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

from distrun._config.parallel_dims import check_global_batch
from distrun._spec.errors import UsageError

__all__ = ["ResumableSampler", "ShardedEvalSampler", "epoch_permutation", "is_map_dataset",
           "local_batch_size"]


def is_map_dataset(data: Any) -> bool:
    """A dataset with a length and an index (sharded by sampler), not a loader or a stream."""
    return hasattr(data, "__getitem__") and hasattr(data, "__len__") and not isinstance(
        data, torch.utils.data.DataLoader)


def local_batch_size(batch_size: int, dp_world: int) -> int:
    """Each data-parallel rank's share of the global ``batch_size`` (which must divide; the
    launcher checks it too, where the strategy declares its layout)."""
    return check_global_batch(batch_size, dp_world)


def epoch_permutation(seed: int, epoch: int, n: int) -> torch.Tensor:
    """The global sample order of ``epoch``: the same on every rank and at every world size."""
    gen = torch.Generator()
    gen.manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=gen)


class ResumableSampler:
    """A batch sampler yielding this rank's index lists from ``cursor`` to the epoch's end.

    The loop calls :meth:`advance` once per consumed micro-batch, so the cursor counts what
    was trained on, not what DataLoader workers prefetched.
    """

    def __init__(self, dataset_len: int, batch_size: int, dp_rank: int, dp_world: int,
                 seed: int = 0, shuffle: bool = True, limit: int = 0,
                 drop_last: bool = True) -> None:
        self.local_batch = local_batch_size(batch_size, dp_world)
        if dataset_len < batch_size:
            raise UsageError(
                f"the training data has {dataset_len} samples, fewer than one global batch of "
                f"{batch_size} (lower --batch-size)"
            )
        self.n = dataset_len
        self.batch_size = batch_size
        self.dp_rank = dp_rank
        self.dp_world = dp_world
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.cursor = 0
        #: the epoch's length in samples: the dataset, padded to whole global batches when
        #: the tail is kept (``drop_last=False``)
        self.total = self.n if drop_last else self.n + (-self.n) % batch_size
        #: where an epoch ends: all of it, or ``limit`` micro-batches
        #: (``--limit-train-batches``, ``--overfit-batches``)
        self.stop = min(self.total, limit * batch_size) if limit else self.total

    def __len__(self) -> int:
        """Micro-batches left in this epoch from the cursor."""
        return max(self.stop - self.cursor, 0) // self.batch_size

    @property
    def batches_per_epoch(self) -> int:
        return self.stop // self.batch_size

    def __iter__(self) -> Iterator[list[int]]:
        if self.shuffle:
            order = epoch_permutation(self.seed, self.epoch, self.n).tolist()
        else:
            order = list(range(self.n))
        if self.total > self.n:
            order = order + order[:self.total - self.n]
        lo = self.dp_rank * self.local_batch
        # a list, converted once an epoch: slicing it costs far less per batch than a tensor
        for start in range(self.cursor, self.stop - self.batch_size + 1, self.batch_size):
            yield order[start + lo:start + lo + self.local_batch]

    def advance(self) -> None:
        self.cursor += self.batch_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.cursor = 0

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "epoch": self.epoch, "cursor": self.cursor,
                "dataset_len": self.n, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["dataset_len"]) != self.n:
            raise UsageError(
                f"the checkpoint's data cursor is for {state['dataset_len']} samples but the "
                f"dataset has {self.n} (resume with the same data, or --resume never)"
            )
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.cursor = int(state["cursor"])


class ShardedEvalSampler:
    """Evaluation batches: rank ``r`` takes samples ``r, r+W, ...`` in batches of ``local_batch``.

    Every rank runs the same number of batches (sharded strategies need equal forward counts):
    a rank with fewer samples repeats its first batch as filler. :attr:`real` says how many
    samples of each batch count (0 for a filler), so a metric averaged over ranks counts every
    sample exactly once, and predictions carry their dataset indices.
    """

    def __init__(self, dataset_len: int, local_batch: int, dp_rank: int, dp_world: int) -> None:
        idx = list(range(dp_rank, dataset_len, dp_world))
        self.batches = [idx[i:i + local_batch] for i in range(0, len(idx), local_batch)]
        self.real = [len(b) for b in self.batches]
        fullest = math.ceil(dataset_len / dp_world)  # samples of the fullest rank
        most = math.ceil(fullest / local_batch)
        filler = self.batches[0] if self.batches else [0]
        while len(self.batches) < most:
            self.batches.append(filler)
            self.real.append(0)

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)
