"""Entry point of distrun-cluster_env (torch-free at import)."""
