"""Entry point of distrun-fsdp (torch-free at import)."""
