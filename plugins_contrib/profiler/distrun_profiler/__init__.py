"""distrun-profiler: torch.profiler traces of a few training steps on every rank."""
