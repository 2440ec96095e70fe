"""The data cursor: one global order, sliced per rank, resumable at any world size."""

from __future__ import annotations

import pytest
import torch

from distrun._spec.errors import UsageError
from distrun._train.sampler import ResumableSampler, ShardedEvalSampler, epoch_permutation


def global_batches(n, batch, world, epoch=0, cursor=0, seed=0):
    """Concatenate every rank's slice of each step: what the whole job trained on."""
    samplers = []
    for r in range(world):
        s = ResumableSampler(n, batch, r, world, seed=seed)
        s.epoch, s.cursor = epoch, cursor
        samplers.append(iter(s))
    return [sum((next(it) for it in samplers), []) for _ in range((n - cursor) // batch)]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_world_size_sees_the_same_global_batches(world):
    assert global_batches(100, 8, world) == global_batches(100, 8, 1)


def test_order_depends_on_seed_and_epoch_only():
    assert torch.equal(epoch_permutation(3, 1, 50), epoch_permutation(3, 1, 50))
    assert not torch.equal(epoch_permutation(3, 1, 50), epoch_permutation(3, 2, 50))
    assert not torch.equal(epoch_permutation(3, 1, 50), epoch_permutation(4, 1, 50))


def test_resume_at_another_world_size_continues_from_the_same_sample():
    full = global_batches(96, 8, 1)
    two = ResumableSampler(96, 8, 0, 2)
    for _ in range(5):
        two.advance()
    state = two.state_dict()
    assert state["cursor"] == 40
    resumed = []
    for r in range(4):
        s = ResumableSampler(96, 8, r, 4)
        s.load_state_dict(state)
        resumed.append(list(s))
    stitched = [sum((resumed[r][i] for r in range(4)), []) for i in range(len(resumed[0]))]
    assert stitched == full[5:]  # nothing replayed, nothing skipped


def test_drop_last_and_len():
    s = ResumableSampler(100, 32, 0, 1)
    assert len(s) == 3 and s.batches_per_epoch == 3
    s.advance()
    assert len(s) == 2


def test_bad_batch_sizes_are_usage_errors():
    with pytest.raises(UsageError, match="not divisible by 3 data-parallel ranks"):
        ResumableSampler(100, 32, 0, 3)
    with pytest.raises(UsageError, match="fewer than one global batch"):
        ResumableSampler(10, 32, 0, 1)
    s = ResumableSampler(100, 10, 0, 1)
    with pytest.raises(UsageError, match="dataset has 100"):
        s.load_state_dict({"dataset_len": 50, "seed": 0, "epoch": 0, "cursor": 0})


def test_eval_sampler_covers_everything_with_equal_batch_counts():
    shards = [list(ShardedEvalSampler(10, 2, r, 3)) for r in range(3)]
    assert len({len(s) for s in shards}) == 1
    seen = {i for s in shards for b in s for i in b}
    assert seen == set(range(10))


@pytest.mark.parametrize("workers", [0, 1])
def test_a_tensor_dataset_is_read_a_batch_at_a_time_with_the_same_batches(workers):
    from distrun._train.loaders import map_loader

    gen = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(40, 3, 2, generator=gen),
                                          torch.randint(0, 9, (40,), generator=gen),
                                          torch.rand(40, generator=gen) > 0.5)
    batches = [epoch_permutation(0, 0, 40)[i:i + 8].tolist() for i in range(0, 40, 8)]
    plain = list(torch.utils.data.DataLoader(data, batch_sampler=batches))
    loader = map_loader(data, batches, num_workers=workers)
    assert not isinstance(loader.dataset, torch.utils.data.TensorDataset)  # the batched read
    read = list(loader)
    assert len(read) == len(plain) == 5
    for ours, theirs in zip(read, plain, strict=True):
        assert type(ours) is type(theirs) is list  # default_collate's form for a tuple sample
        for a, b in zip(ours, theirs, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_a_dataset_with_its_own_collate_or_type_is_read_as_the_dataloader_does():
    from distrun._train.loaders import map_loader

    data = torch.utils.data.TensorDataset(torch.arange(6.0))
    assert map_loader(data, [[0, 1]], collate_fn=len).dataset is data
    sub = torch.utils.data.Subset(data, [5, 4, 3])
    assert map_loader(sub, [[0, 1]]).dataset is sub
    assert [b[0].tolist() for b in map_loader(sub, [[0, 1], [2]])] == [[5.0, 4.0], [3.0]]
