"""distrun-tensorboard: TensorBoard logging for distrun."""
