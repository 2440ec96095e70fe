"""distrun-fsdp: FSDP2 (fully_shard) strategy for distrun."""

__all__: list[str] = []
