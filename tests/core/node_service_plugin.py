"""A third-party plugin that offers a node service (``distrun_node_services``): it writes one
JSON line per start and end of the node's workers into ``$NODE_SERVICE_LOG``, with the ranks,
their pids (and whether each is alive as the service hears of the start) and, at the end,
their exit codes.

Loaded with ``DISTRUN_PLUGINS=node_service_plugin`` (this folder on PYTHONPATH).
"""

from __future__ import annotations

import json
import os
from typing import Any

from distrun.plugin import ProcessId, hookimpl


class Recorder:
    def __init__(self, path: str) -> None:
        self.path = path

    def _write(self, **line: Any) -> None:
        with open(self.path, "a") as fh:
            fh.write(json.dumps({"launcher": os.getpid(), **line}) + "\n")

    def started(self, group: Any) -> None:
        self._write(event="started", ranks=[w.rank for w in group.workers],
                    pids=[w.proc.pid for w in group.workers],
                    alive=[ProcessId(w.proc.pid).alive() for w in group.workers],
                    world=group.ranks.world)

    def ended(self, group: Any) -> None:
        self._write(event="ended", ranks=[w.rank for w in group.workers], codes=group.poll())


@hookimpl
def distrun_node_services(config: Any) -> Recorder | None:
    path = os.environ.get("NODE_SERVICE_LOG")
    return Recorder(path) if path else None
