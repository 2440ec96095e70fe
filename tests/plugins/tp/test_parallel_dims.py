"""distrun._config.parallel_dims: the validated degrees of a dp x tp (x HSDP) mesh (torch-free)."""

from __future__ import annotations

import dataclasses

import pytest

from distrun.plugin import ParallelDims, UsageError
from distrun.testing import imports_torch


def test_degrees_and_mesh_layout() -> None:
    dims = ParallelDims.from_world(8, tp=2, dp_replicate=2)
    assert (dims.dp, dims.tp, dims.dp_replicate, dims.dp_shard) == (4, 2, 2, 2)
    assert dims.mesh_shape == (2, 2, 2)
    assert dims.mesh_dim_names == ("dp_replicate", "dp_shard", "tp")
    assert dims.dp_dim_names == ("dp_replicate", "dp_shard")
    assert str(dims) == "dp 4 (2 replicas x 2 shards) x tp 2 = 8 ranks"
    plain = ParallelDims.from_world(4, tp=2)
    assert (plain.mesh_shape, plain.mesh_dim_names) == ((2, 2), ("dp", "tp"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plain.tp = 4  # type: ignore[misc]


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=4, dp=3, tp=2), "dp 3 x tp 2 = 6, but there are 4 ranks"),
    (dict(world_size=4, dp=4, tp=1, dp_replicate=3), "4 is not divisible by 3"),
    (dict(world_size=4, dp=0, tp=4), "dp must be a whole number >= 1, got 0"),
])
def test_invalid_degrees_name_the_numbers(kwargs: dict, message: str) -> None:
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        ParallelDims(**kwargs)


def test_tp_that_does_not_divide_the_world() -> None:
    with pytest.raises(UsageError, match=r"--tp-size 3 does not divide the world size 4 .*1, 2, 4"):
        ParallelDims.from_world(4, tp=3)


def test_torch_free() -> None:
    assert not imports_torch("distrun._config.parallel_dims", "distrun_tp.plugin")
