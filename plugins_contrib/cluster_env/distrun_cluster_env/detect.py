"""Read where this launcher sits in a job from the variables each scheduler sets (torch-free).

Each reader returns a :class:`distrun.plugin.ClusterEnv` or None. They are tried most
specific first: a process that is already a torch worker (TorchElastic), an MPI rank (mpirun
inside a SLURM allocation still sets the batch step's SLURM variables), a SLURM task, then a
Kubernetes PyTorchJob pod. ``DISTRUN_CLUSTER_ENV=NAME`` forces one reader, ``=none`` turns
detection off (the core's plain environment answers).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping

from distrun.plugin import ClusterEnv, UsageError
from distrun_cluster_env.nodelist import expand_tasks_per_node, first_host

__all__ = ["READERS", "SELECT_ENV", "detect", "mpi", "pytorchjob", "slurm", "torchelastic"]

SELECT_ENV = "DISTRUN_CLUSTER_ENV"
#: torch's default store port, used when nothing in the job fixes one
DEFAULT_PORT = 29500


def _int(environ: Mapping[str, str], *names: str) -> int | None:
    """The first of ``names`` that is set, as an int (None when none is set)."""
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            try:
                return int(value)
            except ValueError:
                raise UsageError(f"{name}={value!r} is not a whole number "
                                 f"(fix the job's environment, or set {SELECT_ENV}=none)") from None
    return None


def _port_from(job_id: str) -> int:
    """A port every process of one job derives alike: 20000-29999, below the ephemeral range."""
    digits = job_id.strip()
    key = int(digits) if digits.isdigit() else zlib.crc32(digits.encode())
    return 20000 + key % 10000


def torchelastic(environ: Mapping[str, str]) -> ClusterEnv | None:
    """A worker started by a TorchElastic agent (torchrun, or elastic agents on Kubernetes)."""
    needed = ("TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK")
    if not all(environ.get(n) for n in needed):
        return None
    return ClusterEnv(
        name="torchelastic", per_process=True,
        rank=_int(environ, "RANK"), local_rank=_int(environ, "LOCAL_RANK"),
        world_size=_int(environ, "WORLD_SIZE"),
        nproc_per_node=_int(environ, "LOCAL_WORLD_SIZE"),
        nnodes=_int(environ, "GROUP_WORLD_SIZE"), node_rank=_int(environ, "GROUP_RANK"),
        master_addr=environ.get("MASTER_ADDR") or None, master_port=_int(environ, "MASTER_PORT"),
    )


def mpi(environ: Mapping[str, str]) -> ClusterEnv | None:
    """A rank started by mpirun: Open MPI (OMPI_COMM_WORLD_*) or MPICH/Intel MPI (PMI_*).

    MPI does not say where rank 0 runs: on one node it is 127.0.0.1, across nodes the job must
    export MASTER_ADDR (``mpirun -x MASTER_ADDR=host0``). The port is MASTER_PORT, else one
    derived from the MPI job id, else 29500.
    """
    if environ.get("OMPI_COMM_WORLD_RANK") and environ.get("OMPI_COMM_WORLD_SIZE"):
        name = "mpi (open mpi)"
        rank = _int(environ, "OMPI_COMM_WORLD_RANK")
        size = _int(environ, "OMPI_COMM_WORLD_SIZE")
        local_rank = _int(environ, "OMPI_COMM_WORLD_LOCAL_RANK")
        local_size = _int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE")
    elif environ.get("PMI_RANK") and environ.get("PMI_SIZE"):
        name = "mpi (pmi)"
        rank = _int(environ, "PMI_RANK")
        size = _int(environ, "PMI_SIZE")
        local_rank = _int(environ, "MPI_LOCALRANKID", "PMI_LOCAL_RANK")
        local_size = _int(environ, "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE")
    else:
        return None
    if rank is None or size is None:
        return None
    if local_size is None:  # no per-node facts: treat the job as one node
        local_rank, local_size = rank, size
    nnodes = max(1, -(-size // local_size))
    addr = environ.get("MASTER_ADDR") or ("127.0.0.1" if nnodes == 1 else None)
    port = _int(environ, "MASTER_PORT")
    if port is None:
        job = next((environ[k] for k in ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid",
                                          "OMPI_MCA_orte_ess_jobid", "PMI_KVSNAME")
                    if environ.get(k)), None)
        port = _port_from(job) if job else DEFAULT_PORT
    return ClusterEnv(
        name=name, per_process=True, rank=rank, world_size=size, local_rank=local_rank,
        nproc_per_node=local_size, nnodes=nnodes, node_rank=rank // local_size,
        master_addr=addr, master_port=port,
    )


def slurm(environ: Mapping[str, str]) -> ClusterEnv | None:
    """A task of an ``srun`` step (step variables first, the job's as fallback).

    One task per node (``--ntasks-per-node=1``): this launcher starts ``--nproc-per-node``
    workers for node SLURM_NODEID. More tasks than nodes: SLURM already started one process per
    rank, so this one runs rank SLURM_PROCID in place (``per_process``).
    """
    if not (environ.get("SLURM_JOB_ID") and environ.get("SLURM_PROCID")):
        return None
    ntasks = _int(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS") or 1
    nnodes = _int(environ, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES") or 1
    node_id = _int(environ, "SLURM_NODEID") or 0
    nodelist = next((environ[k] for k in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST",
                                          "SLURM_NODELIST") if environ.get(k)), "")
    addr = environ.get("MASTER_ADDR") or (first_host(nodelist) if nodelist else None)
    port = _int(environ, "MASTER_PORT") or _port_from(environ["SLURM_JOB_ID"])
    if ntasks <= nnodes:
        return ClusterEnv(name="slurm", nnodes=nnodes, node_rank=node_id,
                          master_addr=addr, master_port=port)
    per_node = next((environ[k] for k in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
                     if environ.get(k)), "")
    counts = expand_tasks_per_node(per_node) if per_node else []
    if node_id < len(counts):
        local_size = counts[node_id]
    else:
        local_size = _int(environ, "SLURM_NTASKS_PER_NODE") or -(-ntasks // nnodes)
    return ClusterEnv(
        name="slurm", per_process=True, rank=_int(environ, "SLURM_PROCID"),
        local_rank=_int(environ, "SLURM_LOCALID") or 0, world_size=ntasks,
        nproc_per_node=local_size, nnodes=nnodes, node_rank=node_id,
        master_addr=addr, master_port=port,
    )


def pytorchjob(environ: Mapping[str, str]) -> ClusterEnv | None:
    """A pod of a Kubeflow PyTorchJob: one launcher per pod, which starts the pod's workers.

    The operator sets MASTER_ADDR/MASTER_PORT and RANK = the pod's index (so the node rank).
    Its WORLD_SIZE counts pods in older operators and pods x nprocPerNode in newer ones, which
    also set PET_NNODES, PET_NODE_RANK and PET_NPROC_PER_NODE; those are read first.
    """
    if environ.get("LOCAL_RANK") or not all(environ.get(n) for n in
                                            ("MASTER_ADDR", "RANK", "WORLD_SIZE")):
        return None
    if not (environ.get("KUBERNETES_SERVICE_HOST") or environ.get("PET_NODE_RANK")
            or environ.get("PET_NNODES")):
        return None
    nproc_raw = environ.get("PET_NPROC_PER_NODE", "").strip()
    nproc = int(nproc_raw) if nproc_raw.isdigit() else None
    nnodes_raw = environ.get("PET_NNODES", "").strip()
    if nnodes_raw.isdigit():
        nnodes: int | None = int(nnodes_raw)
    elif nnodes_raw:  # an elastic range ("1:4"): give --nnodes yourself (elastic plugin)
        nnodes = None
    else:
        world = _int(environ, "WORLD_SIZE") or 1
        nnodes = world // nproc if nproc and world % nproc == 0 else world
    return ClusterEnv(
        name="pytorchjob", nnodes=nnodes, node_rank=_int(environ, "PET_NODE_RANK", "RANK"),
        nproc_per_node=nproc, master_addr=environ["MASTER_ADDR"],
        master_port=_int(environ, "MASTER_PORT"),
    )


READERS: dict[str, Callable[[Mapping[str, str]], ClusterEnv | None]] = {
    "torchelastic": torchelastic,
    "mpi": mpi,
    "slurm": slurm,
    "pytorchjob": pytorchjob,
}


def detect(environ: Mapping[str, str]) -> ClusterEnv | None:
    """The first reader that recognises ``environ`` (or the one ``DISTRUN_CLUSTER_ENV`` names)."""
    choice = environ.get(SELECT_ENV, "auto").strip().lower() or "auto"
    if choice == "none":
        return None
    if choice != "auto":
        if choice not in READERS:
            raise UsageError(f"{SELECT_ENV}={choice!r} is not a cluster environment "
                             f"(use auto, none, {', '.join(READERS)})")
        found = READERS[choice](environ)
        if found is None:
            raise UsageError(f"{SELECT_ENV}={choice} but the {choice} variables are missing "
                             f"(run inside the job, or set {SELECT_ENV}=auto)")
        return found
    for reader in READERS.values():
        found = reader(environ)
        if found is not None:
            return found
    return None
