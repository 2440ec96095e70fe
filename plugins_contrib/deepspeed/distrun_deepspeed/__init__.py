"""distrun-deepspeed: ZeRO stages 1-3 through DeepSpeed itself, checkpoints in distrun's format."""
