"""distrun-ddp: DistributedDataParallel strategy for distrun."""

__all__ = ["COMM_HOOKS"]

from distrun_ddp.options import COMM_HOOKS
