"""Run the tests of one backend (nccl or mpi), or say why they are skipped here and exit 0.

    python .ci/backend_tests.py nccl [pytest args]
"""

import subprocess
import sys

import torch
import torch.distributed as dist

backend, args = sys.argv[1], sys.argv[2:]
if backend == "nccl":
    ok = torch.cuda.is_available() and dist.is_nccl_available()
    reason = ("no CUDA device is visible" if not torch.cuda.is_available()
              else "this torch build has no NCCL")
    marker = "nccl or cuda"
elif backend == "mpi":
    ok = dist.is_mpi_available()
    reason = "this torch build has no MPI backend (torch must be built from source with MPI)"
    marker = "mpi"
else:
    sys.exit(f"unknown backend {backend!r}: use nccl or mpi")
if not ok:
    print(f"SKIPPED: {backend} tests: {reason}")
    sys.exit(0)
sys.exit(subprocess.call([sys.executable, "-m", "pytest", "-m", marker, *(args or ["tests"])]))
