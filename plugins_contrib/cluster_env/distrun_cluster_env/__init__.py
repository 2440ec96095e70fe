"""distrun-cluster-env: SLURM, Kubernetes and MPI environment detection for distrun."""
