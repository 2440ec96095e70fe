"""Entry point of distrun-rpc (torch-free at import)."""
