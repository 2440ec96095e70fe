"""Entry point of distrun-ddp (torch-free at import)."""
