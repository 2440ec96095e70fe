"""Relay the workers' log files to the launcher's terminal through the core's relay.

Torch's agent writes each worker's stdout and stderr into per-attempt files; the core's
:class:`distrun.plugin.Relay` follows each file in a thread and prints its lines as the
local launcher prints pipes (``--tee`` prefix, one tail per rank, a usage error said once).
This module only starts and ends the following of each attempt's files.
"""

from __future__ import annotations

import sys
import threading
import time

from distrun.plugin import RankOutput
from distrun.plugin import Relay as LineRelay

__all__ = ["Relay"]


class Relay:
    """Follow the files of the current attempt; :meth:`next_attempt` for each (re)start."""

    def __init__(self, tee: bool = False) -> None:
        self.lines = LineRelay(tee=tee)
        self._finished = threading.Event()
        self._threads: list[threading.Thread] = []
        #: the current attempt's ranks, by global rank (their last lines for the report)
        self.tails: dict[int, RankOutput] = {}

    def next_attempt(self, files: dict[int, tuple[str, str]]) -> None:
        """Follow ``{global_rank: (stdout_path, stderr_path)}``; let the last attempt drain."""
        self._finished.set()
        finished = self._finished = threading.Event()
        self.lines.new_attempt()  # a restarted group's tracebacks are printed again
        self.tails = {rank: RankOutput(rank) for rank in files}
        for rank, (out, err) in files.items():
            for path, dst in ((out, sys.stdout), (err, sys.stderr)):
                if path:
                    self._threads.append(self.lines.follow(self.tails[rank], path, dst, finished))

    def close(self, timeout: float = 5.0) -> None:
        """Print what is left in the files and stop following them."""
        self._finished.set()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        self._threads = [t for t in self._threads if t.is_alive()]
