"""torch's own backends (gloo, nccl, mpi), offered through the same hook as a plugin's.

Importing this module imports no torch (the launcher registers it); the checks do.
"""

from __future__ import annotations

from distrun._spec.backends import BackendInfo
from distrun._spec.markers import hookimpl

__all__ = ["gloo_unavailable", "mpi_unavailable", "nccl_unavailable"]


def gloo_unavailable() -> str | None:
    import torch.distributed as dist

    if not dist.is_available():
        return "this torch build has no torch.distributed"
    return None if dist.is_gloo_available() else "this torch build has no gloo"


def nccl_unavailable() -> str | None:
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_nccl_available()):
        return "this torch build has no NCCL (a CPU build)"
    return None if torch.cuda.is_available() else "no CUDA device is visible"


def mpi_unavailable() -> str | None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_mpi_available():
        return None
    return "this torch build has no MPI (torch must be built from source with MPI)"


@hookimpl
def distrun_register_backends(register):
    register(BackendInfo("gloo", ("cpu", "cuda"), gloo_unavailable,
                         help="torch's TCP backend: CPU tensors, any number of nodes"))
    register(BackendInfo("nccl", ("cuda",), nccl_unavailable,
                         help="NVIDIA's GPU collectives"))
    register(BackendInfo("mpi", ("cpu", "cuda"), mpi_unavailable,
                         help="the MPI library torch was built with"))
