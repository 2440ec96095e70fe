"""distrun-zero: ZeroRedundancyOptimizer for distrun."""
