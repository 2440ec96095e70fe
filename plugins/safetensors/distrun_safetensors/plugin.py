"""Entry point of distrun-safetensors (torch-free at import)."""
