"""distrun-safetensors: Sharded, crash-consistent safetensors checkpoints for distrun."""
