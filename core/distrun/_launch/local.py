"""The core's local launcher: start this node's workers with torchrun's environment.

Workers get exactly the variables torchrun sets, so a torchrun script runs unchanged. Their
output is relayed line by line (``--tee`` prefixes the rank); Ctrl-C and SIGTERM are forwarded
to every worker; when one fails the others are stopped and its last lines are shown.
Multi-node static runs rendezvous through torch's env:// TCPStore on ``MASTER_ADDR``.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any

from distrun._config.option_values import NPROC_WORDS
from distrun._config.run_config import RunConfig
from distrun._launch.binding import bind_address, listen_socket
from distrun._launch.group import WorkerGroup
from distrun._launch.outputs import worker_outputs
from distrun._launch.ports import check_port, free_port
from distrun._launch.ranks import NodeRanks
from distrun._spec.errors import UsageError

__all__ = ["launch_local", "node_layout", "resolve_nproc"]


def resolve_nproc(value: Any) -> int:
    """torchrun's ``--nproc-per-node``: N, ``cpu``, ``gpu`` (an error without one) or ``auto``."""
    if value not in NPROC_WORDS:
        return int(value)
    if value != "cpu":
        try:
            import torch

            if torch.cuda.is_available():
                return torch.cuda.device_count()
        except ImportError:  # pragma: no cover
            pass
        if value == "gpu":
            raise UsageError("--nproc-per-node gpu: no CUDA device is visible (use a number, "
                             "cpu or auto)")
    return os.cpu_count() or 1


def node_layout(config: RunConfig) -> tuple[int, int]:
    """(nproc_per_node, nnodes) for a static launch; elastic ranges need the elastic plugin."""
    parts = config.nnodes.split(":")
    if len(parts) == 2 and parts[0] != parts[1]:
        raise UsageError(
            f"--nnodes {config.nnodes} asks for an elastic node range: "
            "pip install distrun-elastic (or give a single number)"
        )
    nnodes = int(parts[0])
    return resolve_nproc(config.nproc_per_node), nnodes


def launch_local(config: RunConfig, command: list[str], environ: dict[str, str],
                 cluster: Any = None) -> int:
    """Start this node's workers (or, under srun/mpirun, be the one rank ``cluster`` names)."""
    in_place = per_process_cluster(config, cluster)
    if in_place is not None:
        return launch_in_place(config, command, environ, in_place)
    nproc, nnodes = node_layout(config)
    addr, port = config.master_addr, config.master_port
    if nnodes > 1 and port == 0:
        raise UsageError("--master-port is required with --nnodes > 1 (every node must agree)")
    bind = bind_address(nnodes, addr, config.local_addr)
    store = _store_socket(config, bind, port) if config.node_rank == 0 else None
    if store is not None:
        port = store.getsockname()[1]
    elif port == 0:
        port = free_port(addr)
    elif config.node_rank == 0:
        check_port(addr, port)
    run_id = environ.get("TORCHELASTIC_RUN_ID") or uuid.uuid4().hex[:12]
    ranks = NodeRanks(nproc=nproc, nnodes=nnodes, node_rank=config.node_rank, master_addr=addr,
                      master_port=port, run_id=run_id, role=config.role,
                      signals=config.signals_to_handle, bind=bind)
    group = WorkerGroup(command, ranks, environ=environ, store=store, tee=config.tee,
                        outputs=worker_outputs(config, ranks.base_rank),
                        services=config.node_services())
    return group.run()


def _store_socket(config: RunConfig, bind: str | None, port: int) -> socket.socket | None:
    """The rendezvous store's socket, bound on the run's address, for rank 0 to serve on.

    None where torch binds its own: no bind address decided (several nodes) or an executable
    (``--no-python``) that cannot take the socket over.
    """
    if bind is None or config.no_python:
        return None
    return listen_socket(bind, port)


#: layout fields that, set by a flag, variable or file, turn the per-process path off
_LAYOUT_FIELDS = ("nproc_per_node", "nnodes", "node_rank")
_AGENT_VARS = ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT",
               "TORCHELASTIC_MAX_RESTARTS")


def per_process_cluster(config: RunConfig, cluster: Any) -> Any:
    """``cluster`` (the detected one) when its scheduler started one launcher per rank (srun,
    mpirun). None when it did not, or when the user chose the layout (``--nproc-per-node``
    etc.).
    """
    if cluster is None or not cluster.per_process or None in (cluster.rank, cluster.world_size):
        return None
    if any(not config.sources.get(k, "cluster:").startswith("cluster:") for k in _LAYOUT_FIELDS):
        return None
    return cluster


def launch_in_place(config: RunConfig, command: list[str], environ: dict[str, str],
                    cluster: Any) -> int:
    """Run exactly one worker, rank ``cluster.rank`` of ``cluster.world_size``."""
    nnodes = cluster.nnodes or 1
    if nnodes > 1 and cluster.master_addr is None and "master_addr" not in config.sources:
        raise UsageError(f"{cluster.name} spans {nnodes} nodes but does not say where rank 0 "
                         "runs (export MASTER_ADDR, or pass --master-addr)")
    addr, port = config.master_addr, config.master_port
    if port == 0:
        raise UsageError(f"{cluster.name}: every rank needs the same --master-port (give one)")
    # Under a TorchElastic agent the agent hosts the store and counts the restarts: keep those.
    inherited = {k: environ[k] for k in _AGENT_VARS if k in environ}
    if cluster.rank == 0 and inherited.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        check_port(addr, port)
    outputs = worker_outputs(config, cluster.rank - (cluster.local_rank or 0))
    local = cluster.local_rank or 0
    ranks = NodeRanks(
        nproc=cluster.nproc_per_node or 1, nnodes=nnodes, node_rank=cluster.node_rank or 0,
        world_size=cluster.world_size, first_rank=cluster.rank - local, local_ranks=(local,),
        master_addr=addr, master_port=port,
        run_id=environ.get("TORCHELASTIC_RUN_ID") or config.name or "distrun",
        role=config.role, signals=config.signals_to_handle)
    if environ.get("TORCHELASTIC_ERROR_FILE"):
        outputs.error_dir = None  # the agent's own error file (in ``environ``) is kept
    group = WorkerGroup(command, ranks, environ=environ, extra_env=inherited, tee=config.tee,
                        outputs=outputs, services=config.node_services())
    return group.run()
