"""Entry point of distrun-progress (torch-free at import)."""
