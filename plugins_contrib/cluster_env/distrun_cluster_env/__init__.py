"""distrun-cluster_env: SLURM, Kubernetes and MPI environment detection for distrun."""
