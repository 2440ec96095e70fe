"""Entry point of distrun-amp (torch-free at import)."""
