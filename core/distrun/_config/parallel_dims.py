"""The parallel degrees of a run (pipeline x data x tensor parallel), validated once. Torch-free.

Strategies that build a device mesh (fsdp, tp and their 2D composition) describe it with one
:class:`ParallelDims`, so the check that the degrees multiply to the world size lives in one
place and its error says the numbers. The mesh dimension names are part of the contract:
``"dp"`` (or ``"dp_replicate"`` x ``"dp_shard"`` for HSDP) and ``"tp"``, preceded by ``"pp"``
(outermost) when there are pipeline stages.
"""

from __future__ import annotations

from dataclasses import dataclass

from distrun._spec.errors import UsageError

__all__ = ["ParallelDims", "check_global_batch"]


@dataclass(frozen=True)
class ParallelDims:
    """Pipeline stages ``pp`` x data-parallel degree ``dp`` (= ``dp_replicate`` x ``dp_shard``)
    x ``tp`` = world size.

    ``dp_replicate`` > 1 is HSDP: ``dp_replicate`` groups of ``dp / dp_replicate`` ranks, each
    group holding one sharded copy of the model.
    """

    world_size: int
    dp: int
    tp: int = 1
    dp_replicate: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "dp", "tp", "dp_replicate", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UsageError(f"parallel degree {name} must be a whole number >= 1, "
                                 f"got {value!r}")
        if self.pp * self.dp * self.tp != self.world_size:
            pp = f"pp {self.pp} x " if self.pp > 1 else ""
            raise UsageError(
                f"parallel degrees do not multiply to the world size: {pp}dp {self.dp} x tp "
                f"{self.tp} = {self.pp * self.dp * self.tp}, but there are {self.world_size} ranks "
                f"(choose degrees whose product is {self.world_size})"
            )
        if self.dp % self.dp_replicate:
            raise UsageError(
                f"HSDP needs the data-parallel degree {self.dp} to split into "
                f"{self.dp_replicate} replica groups, and {self.dp} is not divisible by "
                f"{self.dp_replicate} (use a replicate degree that divides {self.dp})"
            )

    @classmethod
    def from_world(cls, world_size: int, tp: int = 1, dp_replicate: int = 1,
                   pp: int = 1) -> ParallelDims:
        """The degrees for ``world_size`` ranks: ``dp`` is what ``pp`` and ``tp`` leave over."""
        if pp < 1 or world_size % pp:
            raise UsageError(
                f"--pp {pp} does not divide the world size {world_size} (use a number of "
                f"pipeline stages that divides {world_size}, e.g. {_divisors(world_size)})"
            )
        if tp < 1 or (world_size // pp) % tp:
            raise UsageError(
                f"--tp-size {tp} does not divide the world size {world_size} "
                f"(use a tensor-parallel size that divides {world_size}, e.g. "
                f"{_divisors(world_size)})"
            )
        return cls(world_size=world_size, dp=world_size // pp // tp, tp=tp,
                   dp_replicate=dp_replicate, pp=pp)

    @property
    def dp_shard(self) -> int:
        """Ranks over which FSDP shards parameters (``dp`` without HSDP)."""
        return self.dp // self.dp_replicate

    @property
    def dp_dim_names(self) -> tuple[str, ...]:
        """The mesh dimensions data parallelism runs over (``fully_shard``'s mesh)."""
        return ("dp_replicate", "dp_shard") if self.dp_replicate > 1 else ("dp",)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The device mesh shape, outermost dimension first (tp innermost: neighbours)."""
        dp = (self.dp_replicate, self.dp_shard) if self.dp_replicate > 1 else (self.dp,)
        return (*((self.pp,) if self.pp > 1 else ()), *dp, self.tp)

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return (*(("pp",) if self.pp > 1 else ()), *self.dp_dim_names, "tp")

    def __str__(self) -> str:
        hsdp = f" ({self.dp_replicate} replicas x {self.dp_shard} shards)" \
            if self.dp_replicate > 1 else ""
        pp = f"pp {self.pp} x " if self.pp > 1 else ""
        return f"{pp}dp {self.dp}{hsdp} x tp {self.tp} = {self.world_size} ranks"


def check_global_batch(batch_size: int, dp_world: int) -> int:
    """Each data-parallel rank's share of the global ``batch_size``, which must divide."""
    if batch_size % dp_world:
        raise UsageError(
            f"batch_size {batch_size} is not divisible by {dp_world} data-parallel ranks "
            f"(batch_size is the global batch; use a multiple of {dp_world})"
        )
    return batch_size // dp_world


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
