"""Who is who in an RPC run: trainers first, parameter servers last. Torch-free.

Trainers take global ranks ``0 .. T-1`` so trainer ``r`` is also rank ``r``: rank 0 logs and
checkpoints as in every other strategy, and the trainers' process group keeps torchrun's rank
numbers. The ``S`` parameter servers are the last ranks ``T .. T+S-1``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from distrun.plugin import UsageError

__all__ = ["Roles", "assign_shards"]

TRAINER = "trainer"
SERVER = "server"


@dataclass(frozen=True)
class Roles:
    """The role layout of one rank: ``Roles.of(rank, world_size, servers)``."""

    rank: int
    world_size: int
    servers: int

    @classmethod
    def of(cls, rank: int, world_size: int, servers: int) -> Roles:
        if servers < 1:
            raise UsageError(f"--rpc-servers {servers}: at least one parameter server is needed")
        if world_size - servers < 1:
            raise UsageError(
                f"--rpc-servers {servers} leaves no trainer among {world_size} processes "
                f"(use --nproc-per-node {servers + 1} or more, or fewer servers)"
            )
        return cls(rank, world_size, servers)

    @property
    def trainers(self) -> int:
        return self.world_size - self.servers

    @property
    def is_server(self) -> bool:
        return self.rank >= self.trainers

    @property
    def role(self) -> str:
        return SERVER if self.is_server else TRAINER

    @property
    def role_rank(self) -> int:
        return self.rank - self.trainers if self.is_server else self.rank

    @property
    def role_world_size(self) -> int:
        return self.servers if self.is_server else self.trainers

    @property
    def name(self) -> str:
        """This rank's RPC worker name (``trainer0``, ``server1``)."""
        return f"{self.role}{self.role_rank}"

    def server_name(self, index: int) -> str:
        return f"{SERVER}{index}"

    def server_rank(self, index: int) -> int:
        return self.trainers + index

    def describe(self, name: str) -> str:
        """``'server0' -> 'parameter server 0 (rank 2)'``, for error messages."""
        if name.startswith(SERVER):
            index = int(name[len(SERVER):])
            return f"parameter server {index} (rank {self.server_rank(index)})"
        index = int(name[len(TRAINER):])
        return f"trainer {index} (rank {index})"

    def export(self, environ: dict[str, str] | None = None) -> None:
        """Set torchelastic's role variables (``ROLE_NAME``, ``ROLE_RANK``...) for this rank."""
        env = os.environ if environ is None else environ
        env["ROLE_NAME"] = self.role
        env["ROLE_RANK"] = str(self.role_rank)
        env["ROLE_WORLD_SIZE"] = str(self.role_world_size)


def assign_shards(sizes: Sequence[int], servers: int) -> list[int]:
    """The server of each parameter: largest first onto the least-loaded server.

    Deterministic (ties keep declaration order), so every rank computes the same placement.
    """
    load = [0] * servers
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        target = min(range(servers), key=lambda s: (load[s], s))
        owner[i] = target
        load[target] += sizes[i]
    return owner
