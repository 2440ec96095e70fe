"""Exit 0 after printing why a backend's tests are skipped here; tox runs pytest only if present."""

import sys

import torch
import torch.distributed as dist

backend = sys.argv[1]
if backend == "nccl":
    ok = torch.cuda.is_available() and dist.is_nccl_available()
    reason = "no CUDA device is visible" if not torch.cuda.is_available() else "torch lacks NCCL"
else:
    ok = dist.is_mpi_available()
    reason = "this torch build has no MPI backend (build torch from source with MPI)"
if not ok:
    print(f"SKIPPED {backend}: {reason}")
    sys.exit(0)
print(f"{backend} available")
