"""distrun-ddp: DistributedDataParallel strategy for distrun."""
