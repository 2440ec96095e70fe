"""distrun-ddp: DistributedDataParallel strategy for distrun."""

__all__ = ["COMM_HOOKS"]

from distrun_ddp.plugin import COMM_HOOKS
