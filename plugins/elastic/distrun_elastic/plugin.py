"""Entry point of distrun-elastic (torch-free at import)."""
