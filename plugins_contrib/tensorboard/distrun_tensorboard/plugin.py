"""Entry point of distrun-tensorboard (torch-free at import)."""
