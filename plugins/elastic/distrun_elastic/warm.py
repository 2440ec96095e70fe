"""Workers forked from warm spares under torch's agent (imports torch).

torch has no hook for how its agent makes a worker process: its ``SubprocessContext`` asks
``get_subprocess_handler`` for a handler, and the handler's ``_popen`` makes the process.
:func:`fork_workers_warm` replaces that name with one whose handler forks the worker from the
agent's :class:`distrun.plugin.WarmPool` when a spare is ready, with the exact arguments,
environment, files and working directory ``Popen`` would give it, else starts it with ``Popen``
as before. The process runs one agent, so the replacement is its own affair (as the agent's
``_skip_join_skew``); it forks only inside :func:`forking_from`, around the agent's start of its
workers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from distrun.plugin import WarmPool

__all__ = ["fork_workers_warm", "forking_from"]

#: the spares of the agent whose workers are being started (None: start them with Popen)
_starting: list[WarmPool] = []


@contextlib.contextmanager
def forking_from(pool: WarmPool | None) -> Iterator[None]:
    """Workers started meanwhile are forked from ``pool`` where it can (None: none are)."""
    if pool is None:
        yield
        return
    _starting.append(pool)
    try:
        yield
    finally:
        _starting.remove(pool)


def fork_workers_warm() -> None:
    """Have torch's agent make each worker through the warm handler (once per process)."""
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

    if getattr(api.get_subprocess_handler, "distrun_warm", False):
        return

    class WarmHandler(SubprocessHandler):
        def _popen(self, args: tuple, env: dict[str, str]) -> Any:
            if _starting:
                stdio = (0, self._stdout.fileno() if self._stdout else 1,
                         self._stderr.fileno() if self._stderr else 2)
                proc = _starting[-1].spawn(self.local_rank_id, args, env, stdio)
                if proc is not None:
                    return proc
            return super()._popen(args, env)

    def warm_handler(entrypoint: str, args: tuple, env: dict[str, str], stdout: str,
                     stderr: str, local_rank_id: int, numa_options: Any = None) -> Any:
        return WarmHandler(entrypoint=entrypoint, args=args, env=env, stdout=stdout,
                           stderr=stderr, local_rank_id=local_rank_id, numa_options=numa_options)

    warm_handler.distrun_warm = True  # type: ignore[attr-defined]
    api.get_subprocess_handler = warm_handler
