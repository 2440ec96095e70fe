"""distrun-zero: ZeroRedundancyOptimizer (optimizer state sharded over DDP ranks)."""
