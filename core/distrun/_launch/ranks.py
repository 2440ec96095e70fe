"""Where a node's ranks sit in the run, and the environment that tells each of them (torch-free).

:func:`torchrun_env` is exactly the variables torchrun gives a worker; :class:`NodeRanks` is
one node's share of the run (its ranks, the world, the rendezvous address) and builds a
rank's whole environment: the launcher's own, torchrun's variables, where the rank's servers
listen, the launcher's pid for the worker's lifeline, one OpenMP thread per rank where ranks
share the node, and the launcher's own variables last.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from distrun._config.option_values import DEFAULT_SIGNALS
from distrun._config.run_config import CONFIG_ENV
from distrun._diagnose.position import PART_ENV
from distrun._launch.binding import STORE_FD_ENV, server_env
from distrun._launch.folder_lock import RUN_KEY_ENV
from distrun._launch.generation import GENERATION_ENV
from distrun._launch.lifeline import LAUNCHER_PID_ENV

__all__ = ["NodeRanks", "torchrun_env"]


def torchrun_env(*, rank: int, local_rank: int, world_size: int, local_world_size: int,
                 node_rank: int, nnodes: int, master_addr: str, master_port: int,
                 run_id: str, restart_count: int = 0, max_restarts: int = 0,
                 role: str = "default", signals: str = DEFAULT_SIGNALS,
                 error_file: str | None = None,
                 environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables torchrun gives a worker (see torch.distributed.run and its agent).

    ``TORCHELASTIC_USE_AGENT_STORE`` is False: rank 0 hosts the store (env://), no agent does.
    ``error_file`` is where torch's ``@record`` writes a failing worker's error.
    """
    environ = os.environ if environ is None else environ
    env: dict[str, Any] = {
        "RANK": rank, "LOCAL_RANK": local_rank, "WORLD_SIZE": world_size,
        "LOCAL_WORLD_SIZE": local_world_size, "GROUP_RANK": node_rank,
        "GROUP_WORLD_SIZE": nnodes, "ROLE_RANK": rank, "ROLE_WORLD_SIZE": world_size,
        "ROLE_NAME": role, "MASTER_ADDR": master_addr, "MASTER_PORT": master_port,
        "TORCHELASTIC_RESTART_COUNT": restart_count, "TORCHELASTIC_MAX_RESTARTS": max_restarts,
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "TORCHELASTIC_SIGNALS_TO_HANDLE": signals,
    }
    if error_file:
        env["TORCHELASTIC_ERROR_FILE"] = error_file
    return {k: str(v) for k, v in env.items()}


@dataclass(frozen=True)
class NodeRanks:
    """Where this node's ranks sit in the run: what torchrun's variables tell each of them.

    ``local_ranks`` are the local ranks this group starts (all of ``nproc`` by default; a
    scheduler that starts one launcher per rank gives one). ``workers_here`` is how many
    worker processes share this node's cores (several replica groups, say): above one, each
    rank gets one OpenMP thread unless the user set ``OMP_NUM_THREADS``.
    """

    nproc: int
    master_addr: str
    master_port: int
    run_id: str
    node_rank: int = 0
    nnodes: int = 1
    world_size: int = 0  # 0: nproc * nnodes
    first_rank: int = -1  # -1: node_rank * nproc
    local_ranks: tuple[int, ...] = ()
    restart_count: int = 0
    max_restarts: int = 0
    role: str = "default"
    signals: str = DEFAULT_SIGNALS
    #: the address the ranks' servers listen on (gloo, tensorpipe, the store); None: torch's
    bind: str | None = None
    workers_here: int = 0  # 0: nproc
    #: the run config the workers take, a ``RunConfig`` or its ``to_json()`` text
    #: (``DISTRUN_CONFIG``; None: the launcher's environment's)
    config: Any = None
    #: the rendezvous round of a re-forming launcher (``DISTRUN_RDZV_GENERATION``; None: none)
    generation: int | None = None
    #: the run's key, one per run (``DISTRUN_RUN_KEY``; "": the launcher's environment's)
    run_key: str = ""

    @property
    def world(self) -> int:
        return self.world_size or self.nproc * self.nnodes

    @property
    def base_rank(self) -> int:
        return self.node_rank * self.nproc if self.first_rank < 0 else self.first_rank

    @property
    def locals(self) -> tuple[int, ...]:
        return self.local_ranks or tuple(range(self.nproc))

    def rank_of(self, local_rank: int) -> int:
        return self.base_rank + local_rank

    @property
    def part(self) -> tuple[int, int]:
        """(index, count) of this group among the groups the run's ranks are started in: the
        node and the nodes, or the rank and the world where a launcher starts one rank (srun's
        tasks, Ray's actors), on one node too. What the groups share among themselves (their
        stall reports, :mod:`distrun._diagnose.exchange`) is keyed by it."""
        if self.unit == "rank":
            return self.rank_of(self.local_ranks[0]), self.world
        return self.node_rank, self.nnodes

    @property
    def unit(self) -> str:
        """What :attr:`part` counts: ``"rank"`` where a launcher starts one rank of several on
        its node, else ``"node"`` (the words of the stall lines and folders)."""
        return "rank" if len(self.local_ranks) == 1 and self.world > self.nnodes else "node"

    def env(self, local_rank: int, environ: Mapping[str, str],
            extra: Mapping[str, str] | None = None, error_file: str | None = None,
            store_fd: int | None = None) -> dict[str, str]:
        """The whole environment of local rank ``local_rank``: ``environ``, torchrun's
        variables, the servers' address, the launcher's pid, the run's config, generation and
        key, then ``extra``. ``store_fd``: the rendezvous socket global rank 0 inherits."""
        env = dict(environ)
        env.update(torchrun_env(
            rank=self.rank_of(local_rank), local_rank=local_rank, world_size=self.world,
            local_world_size=self.nproc, node_rank=self.node_rank, nnodes=self.nnodes,
            master_addr=self.master_addr, master_port=self.master_port, run_id=self.run_id,
            restart_count=self.restart_count, max_restarts=self.max_restarts, role=self.role,
            signals=self.signals, error_file=error_file, environ=environ))
        env.update(server_env(self.bind, environ))
        env[LAUNCHER_PID_ENV] = str(os.getpid())
        if (self.workers_here or self.nproc) > 1:
            env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("PYTHONUNBUFFERED", "1")
        if self.config is not None:
            env[CONFIG_ENV] = self.config if isinstance(self.config, str) else self.config.to_json()
        if self.generation is not None:
            env[GENERATION_ENV] = str(self.generation)
        if self.run_key:
            env[RUN_KEY_ENV] = self.run_key
        if self.part != (self.node_rank, self.nnodes):  # (a launcher that starts one rank)
            env[PART_ENV] = "{}/{}".format(*self.part)
        if store_fd is not None and self.rank_of(local_rank) == 0:
            env[STORE_FD_ENV] = str(store_fd)
        env.update(extra or {})
        return env
