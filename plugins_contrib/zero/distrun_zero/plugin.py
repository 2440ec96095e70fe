"""Entry point of distrun-zero (torch-free at import)."""
