"""distrun-fsdp: FSDP2 (fully_shard) strategy for distrun."""
