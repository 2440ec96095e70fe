"""distrun-ft's options, read typed with ``FtOptions.of(config)`` (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from distrun.plugin import PluginOptions, option


@dataclass(frozen=True)
class FtOptions(PluginOptions, plugin="ft"):
    """Fault tolerance without a restart (``FtOptions.of(config)``)."""

    ft: bool = option(
        False, "fault tolerance without a restart (torchft): replica groups keep training when "
        "one dies; the launcher restarts it and it heals from a live peer")
    replica_groups: int = option(
        2, "replica groups this launcher starts under --ft, each of --nproc-per-node ranks",
        min=1)
    ft_lighthouse: str = option(
        "", "the run's torchft lighthouse, http://HOST:PORT: the launcher on the host that owns "
        "HOST serves it there, the others use it (default: one on loopback, this host only)", metavar="URL")
    ft_max_restarts: int = option(
        3, "restarts of each replica group after it dies (its own budget; --max-restarts is "
        "the elastic plugin's whole-job restart)", min=0)
    ft_heartbeat: float = option(
        2.0, "seconds without a heartbeat before a replica group is dropped from the quorum: "
        "the survivors' stall after a group dies is at most this plus one second",
        min=0.2, metavar="SECONDS")
    ft_first_replica: int = option(
        0, "the index of this launcher's first replica group, when launchers on several hosts "
        "share one --ft-lighthouse: give each host its own range (host k of N groups each: "
        "k*N), so the groups' ids, run folders and logs do not collide", min=0)
    ft_sync: str = option(
        "", "how often the groups sync, for slow links between them: every step (default: "
        "the gradients, each step), localsgd:N (the weights averaged every N local steps) or "
        "diloco:N (DiLoCo: every N local steps the averaged weight change, applied by an "
        "outer Nesterov SGD)", metavar="MODE:N")
    ft_min_replicas: int = option(1, "replica groups a step needs to commit", min=1)
