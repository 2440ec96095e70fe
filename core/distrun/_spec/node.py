"""What runs beside a node's ranks: the interface of a per-node service.

A launcher's worker group (:class:`distrun.plugin.WorkerGroup`) starts the ranks of one node
under every launcher (local, elastic, distrun-ft). A plugin that needs to be there for as
long as those ranks live (a watcher of their progress, a memory tier that outlives a worker)
offers a :class:`NodeService` through the ``distrun_node_services`` hook; the group tells it of
each start of its workers and of their end, in the launcher process (no torch imported).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["NodeService"]


@runtime_checkable
class NodeService(Protocol):
    """Told of each start of a node's workers, and of their end (a restart is an end and a
    start). ``group`` is the :class:`~distrun.plugin.WorkerGroup`: ``group.workers`` (each
    with ``rank``, ``local_rank`` and ``proc.pid``), ``group.ranks`` (the layout),
    ``group.poll()`` (exit codes). Both are called in the launcher process, on the thread that
    starts or stops the workers (the elastic agent stops a cut-off node's from its heartbeat
    thread): return promptly (start a thread for long work). The end of a restart's workers is
    told once each has begun to exit, before the kernel has freed their memory (the next
    workers start then): a failure's code shows already, a clean exit's (0, 143) reads None.

    A service may also define ``worker_env(group) -> Mapping[str, str]``: variables every
    worker of ``group`` starts with (added after the launcher's own), asked at each start
    before the workers exist. That is how a service hands the ranks what it holds for them
    (the memory tier its folder). The launcher keeps one service object for all its groups and
    restarts, so what the service made lives as long as the launcher does.

    A launcher whose groups run in processes of their own (distrun-ray's actors, one rank
    each) hands each group a copy (the service must pickle), and new copies to the groups of
    a restart, placed anew. A service whose point is what it keeps from one start of the
    workers to the next (the memory tier) says so with a true ``across_restarts`` and is
    left out there."""

    def started(self, group: Any) -> None: ...

    def ended(self, group: Any) -> None: ...
