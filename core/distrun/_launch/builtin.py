"""The core's launch plugin: a plain local environment and the local launcher, tried last.

Registered as ``launch``; cluster plugins (SLURM, Kubernetes, MPI) and other launchers
(elastic, Ray) answer before it.
"""

from __future__ import annotations

from typing import Any

from distrun._spec.cluster import ClusterEnv
from distrun._spec.markers import hookimpl


@hookimpl(trylast=True)
def distrun_detect_cluster(environ: dict[str, str]) -> ClusterEnv:
    return ClusterEnv(name="local")


@hookimpl(trylast=True)
def distrun_launch(config: Any, command: list[str], environ: dict[str, str],
                   cluster: ClusterEnv | None) -> int:
    from distrun._launch.local import launch_local

    return launch_local(config, command, environ, cluster)


@hookimpl
def distrun_node_services(config: Any) -> Any:
    """The stall watcher beside every group of workers (``--stall-timeout 0``: it only
    describes the run for ``distrun stacks``)."""
    from distrun._diagnose.watcher import StallWatcher

    return StallWatcher(config)
