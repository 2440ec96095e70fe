"""distrun-tp: tensor-parallel strategy (and the tp half of fsdp x tp) for distrun."""

__all__: list[str] = []
