"""distrun-tensorboard: TensorBoard event files of a run's metrics, written on rank 0."""
