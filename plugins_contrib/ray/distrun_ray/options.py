"""The ray plugin's options, read typed with ``RayOptions.of(config)`` (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from distrun.plugin import PluginOptions, option


@dataclass(frozen=True)
class RayOptions(PluginOptions, plugin="ray"):
    """The ray plugin's options (``RayOptions.of(config)``)."""

    launcher: str = option(
        "local", "who starts the workers: this node ('local') or a Ray cluster ('ray')",
        choices=("local", "ray"))
    ray_address: str = option(
        "", "Ray cluster to use, HOST:PORT (default: $RAY_ADDRESS, else a new local Ray instance)")
    ray_num_workers: int = option(
        0, "ranks to start as Ray actors (0: nproc-per-node x nnodes)",
        min=0)
    ray_cpus_per_worker: float = option(1.0, "CPUs Ray reserves for each rank", min=0)
    ray_gpus_per_worker: float = option(0.0, "GPUs Ray reserves for each rank", min=0)
    ray_placement: str = option(
        "PACK", "how Ray places the ranks on nodes",
        choices=("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"))
    ray_max_restarts: int = option(
        0, "restart the whole group this many times after a failure, resuming from the newest "
        "checkpoint (default: --max-restarts when declared)",
        min=0)
    ray_start_timeout: float = option(
        120.0, "seconds to wait for the cluster to place the ranks",
        min=1)
    ray_env: str = option(
        "", "extra launcher variables to hand to workers, NAME[,NAME...] (DISTRUN_*, TORCH*, "
        "NCCL_*, GLOO_*, OMP_*, PYTHONPATH always are)")
