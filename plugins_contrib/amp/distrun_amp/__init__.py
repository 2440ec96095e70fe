"""distrun-amp: mixed precision (bf16 autocast; float16 with a GradScaler on CUDA)."""
