"""The elastic plugin's options, read typed with ``ElasticOptions.of(config)`` (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from distrun.plugin import PluginOptions, option


@dataclass(frozen=True)
class ElasticOptions(PluginOptions, plugin="elastic", launcher_only=True):
    """The elastic plugin's options (``ElasticOptions.of(config)``).

    Names mirror torchrun's flags (no plugin prefix); torchrun's spellings are aliases. Only
    the launcher reads them: after a script, they are warned about.
    """

    max_restarts: int = option(
        0, "restart all workers up to N times after a failure, from the latest checkpoint",
        min=0, aliases=("--max_restarts",))
    rdzv_backend: str = option(
        "c10d", "torch rendezvous backend",
        choices=("c10d", "static", "etcd", "etcd-v2"), aliases=("--rdzv_backend",))
    rdzv_endpoint: str = option(
        "",
        "rendezvous address, the same on every node (default: 127.0.0.1 and a free port on one "
        "node)",
        metavar="HOST:PORT", aliases=("--rdzv_endpoint",))
    rdzv_id: str = option(
        "", "rendezvous id shared by the nodes of one job (also names the run)",
        metavar="ID", aliases=("--rdzv_id",))
    rdzv_conf: str = option(
        "", "extra rendezvous settings, e.g. last_call_timeout=5,join_timeout=600",
        metavar="K=V,...", aliases=("--rdzv_conf",))
    heartbeat_timeout: float = option(
        15.0, "seconds without a heartbeat from another node's agent before the others re-form "
        "without it (a host that is down, frozen or cut off); --timeout still bounds a "
        "collective that is merely slow",
        min=1.0, metavar="SECONDS")
    warm_restart: bool = option(
        True, "fork every start of a worker, restarts included, from a per-rank spare that has "
        "imported torch already (--no-warm-restart: each start is a new interpreter)")
    monitor_interval: float = option(
        0.1, "how often the agent checks on the workers",
        min=0.01, metavar="SECONDS", aliases=("--monitor_interval",))
