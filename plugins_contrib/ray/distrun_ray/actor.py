"""The Ray actor that hosts one rank: it starts the worker process on its node and relays it.

Imported by the launcher and by Ray's worker processes (not by the entry point). The worker is
started by a :class:`distrun.plugin.WorkerGroup` of one rank, with torchrun's variables exactly
as the local launcher gives them, so a torchrun script or a distrun task runs unchanged; the
actor queues its output for the launcher's polls and stops it. The worker dies with the actor
(its lifeline names the actor as its launcher).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["RankHost"]


class RankHost:
    """One rank's host on a Ray node (wrapped with ``ray.remote`` by the launcher)."""

    def __init__(self) -> None:
        self.group: Any = None  # the worker's WorkerGroup, once started
        self.lines: collections.deque[tuple[str, str]] = collections.deque()
        self.store: socket.socket | None = None  # rank 0's store socket, until start()

    def node(self) -> tuple[str, str, str]:
        """(IP address, Ray node id, host name) of the node this actor was placed on."""
        import ray

        return (ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id(),
                socket.gethostname())

    def store_port(self, bind: str | None) -> int:
        """The port of rank 0's store on this node.

        With a bind address the socket is bound here, on that address only, and kept for the
        worker :meth:`start` starts next, which serves the store on it (torch's own would listen
        on every interface). Without one: a port free on this node's address.
        """
        import ray

        from distrun.plugin import free_port, listen_socket

        if bind is None:
            return free_port(ray.util.get_node_ip_address())
        self.store = listen_socket(bind, 0)
        return self.store.getsockname()[1]

    def start(self, command: Sequence[str], ranks: Any, base: Mapping[str, str], cwd: str,
              bind: str | None = None, services: Sequence[Any] = ()) -> int:
        """Start the worker with this node's Python: ``ranks`` is the rank's
        :class:`~distrun.plugin.NodeRanks`, ``base`` the launcher's variables added to the
        actor's own.

        ``bind``: the address the worker's servers listen on (gloo's and tensorpipe's interface
        is looked up on this node). ``services``: the node services beside the rank (the stall
        watcher: its lines go to the launcher with the rank's output).
        """
        from distrun.plugin import WorkerGroup

        argv = [sys.executable, *command[1:]]  # the launcher's interpreter path may differ here
        self.lines.clear()
        if os.path.isdir(cwd):
            os.chdir(cwd)  # (this process serves this rank alone: its folders resolve there)
        self.group = WorkerGroup(
            argv, dataclasses.replace(ranks, bind=bind), environ={**os.environ, **base},
            store=self.store, relay=self._queue, services=services,
            cwd=cwd if os.path.isdir(cwd) else None)
        self.store = None  # the group closes it once the worker holds it
        self.group.start()
        return int(self.group.workers[0].proc.pid)

    def _queue(self, stream: str, text: str) -> None:
        """Queue the worker's output as it comes (pieces of lines too: a ``\r`` redraw) for
        the launcher to print, instead of printing it here."""
        self.lines.append((stream, text))

    def poll(self) -> tuple[list[tuple[str, str]], int | None, str | None]:
        """New output since the last poll (``out``, ``err``, or ``say``: a line of a node
        service's), the exit code once the worker is done, and why the group ended it
        itself (a stall's line; None: it did not)."""
        code = None if self.group is None else self.group.poll()[0]
        if code is not None:
            self.group.stop(grace=0.0)  # reaped, and all its lines read before the exit is said
        out = []
        while self.lines:
            out.append(self.lines.popleft())
        return out, code, None if self.group is None else self.group.aborted

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the worker (and its children)."""
        if self.group is not None:
            self.group.signal_all(signum)

    def stop(self, grace: float) -> int | None:
        """SIGTERM, then SIGKILL after ``grace`` seconds; the exit code."""
        if self.group is None:
            return None
        self.group.stop(grace)
        return self.group.poll()[0]
