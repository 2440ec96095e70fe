"""Entry point of distrun-join (torch-free at import)."""
