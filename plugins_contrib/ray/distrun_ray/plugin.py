"""Entry point of distrun-ray (torch-free at import)."""
