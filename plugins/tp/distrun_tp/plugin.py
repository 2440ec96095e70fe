"""Entry point of distrun-tp (torch-free at import)."""
