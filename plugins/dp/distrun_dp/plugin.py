"""Entry point of distrun-dp (torch-free at import)."""
