"""What a cluster environment tells the launcher (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ClusterEnv"]


@dataclass(frozen=True)
class ClusterEnv:
    """Where this launcher sits in a job, as detected by ``distrun_detect_cluster``.

    Fields left ``None`` fall back to flags or defaults. ``per_process`` is true when the
    scheduler already started one process per rank (``srun`` tasks, ``mpirun``): the launcher
    then runs one worker in place with ``rank``/``local_rank`` instead of spawning
    ``nproc_per_node`` workers.
    """

    name: str
    nnodes: int | None = None
    node_rank: int | None = None
    nproc_per_node: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    per_process: bool = False
    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
