"""Entry point of distrun-ray (imports neither torch nor ray): options and the launcher hook."""

from __future__ import annotations

from distrun.plugin import hookimpl, plugin_options

DISTRUN_PLUGIN_API = 1  # the distrun.plugin API this plugin is written for

PLUGIN = "ray"


@hookimpl
def distrun_register_options(register):
    opt = plugin_options(register, PLUGIN)
    opt("launcher", str, "local", "who starts the workers: this node ('local') or a Ray "
        "cluster ('ray')", choices=("local", "ray"))
    opt("ray_address", str, "", "Ray cluster to use, HOST:PORT (default: $RAY_ADDRESS, else a "
        "new local Ray instance)")
    opt("ray_num_workers", int, 0, "ranks to start as Ray actors (0: nproc-per-node x nnodes)",
        min=0)
    opt("ray_cpus_per_worker", float, 1.0, "CPUs Ray reserves for each rank", min=0)
    opt("ray_gpus_per_worker", float, 0.0, "GPUs Ray reserves for each rank", min=0)
    opt("ray_placement", str, "PACK", "how Ray places the ranks on nodes",
        choices=("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"))
    opt("ray_max_restarts", int, 0, "restart the whole group this many times after a failure, "
        "resuming from the newest checkpoint (default: --max-restarts when declared)", min=0)
    opt("ray_start_timeout", float, 120.0, "seconds to wait for the cluster to place the ranks",
        min=1)
    opt("ray_env", str, "", "extra launcher variables to hand to workers, NAME[,NAME...] "
        "(DISTRUN_*, TORCH*, NCCL_*, GLOO_*, OMP_*, PYTHONPATH always are)")


@hookimpl(tryfirst=True)
def distrun_launch(config, command, environ):
    if config.get("launcher", "local") != "ray":
        return None
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        from distrun.plugin import UsageError

        raise UsageError("--launcher ray needs Ray: pip install 'ray>=2.9'")
    from distrun_ray.launcher import launch_ray

    return launch_ray(config, command, environ)
