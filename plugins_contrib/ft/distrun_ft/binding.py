"""torchft's two servers kept on the run's address (worker side; imports torchft).

torchft gives no bind address for either: its ``ManagerServer`` (rank 0 of a group) binds
``[::]:PORT`` inside ``Manager.__init__``, and its process group hosts the cross-group
rendezvous store on a ``TCPStore`` master, which listens on every interface and is announced
under ``socket.gethostname()``. distrun wraps both, for torchft-nightly==2026.10.26 (the pin):

- :func:`manager_server_on` replaces the ``ManagerServer`` that ``torchft.manager`` calls, for
  the time of one ``Manager(...)`` call, by one whose ``bind`` is ``ADDRESS:PORT``;
- :func:`process_group_on` is torchft's ``ProcessGroupGloo`` whose rendezvous store serves a
  socket distrun bound on ``ADDRESS`` (``master_listen_fd``) and is announced as ``ADDRESS``.

``ADDRESS`` is the launcher's (``DISTRUN_FT_ADDRESS``): 127.0.0.1 on one host, the host's
address on the route to ``--ft-lighthouse`` (or ``--local-addr``) when the groups span hosts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from distrun.plugin import listen_socket, serve_store

__all__ = ["ForeignQuorum", "manager_server_on", "process_group_on"]


class ForeignQuorum(RuntimeError):
    """A quorum that lacks the process-group handles this torchft exchanges through the
    lighthouse: the lighthouse, or a participant, runs another torchft (torchft reports no
    version, on either side; a torchft==0.2.0 lighthouse, or client, is one that does this)."""


def _hostport(address: str, port: int | str) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


@contextmanager
def manager_server_on(address: str) -> Iterator[None]:
    """Within the block, ``torchft.manager`` starts its ManagerServer on ``address``."""
    import torchft.manager as manager_module

    real = manager_module.ManagerServer

    def bound(*args: Any, **kwargs: Any) -> Any:
        bind = kwargs.get("bind")
        if bind is None:
            raise RuntimeError("torchft's ManagerServer is not called with bind=...: this "
                               "torchft is not the one distrun-ft pins")
        kwargs["bind"] = _hostport(address, str(bind).rpartition(":")[2])
        return real(*args, **kwargs)

    manager_module.ManagerServer = bound
    try:
        yield
    finally:
        manager_module.ManagerServer = real


def process_group_on(address: str, timeout: timedelta) -> Any:
    """torchft's ``ProcessGroupGloo`` with its rendezvous store on ``address``."""
    from torchft.process_group import ProcessGroupGloo

    class BoundProcessGroupGloo(ProcessGroupGloo):
        _rendezvous_store: Any

        def get_reconfigure_handle(self) -> str:
            if self._rendezvous_store is None:
                self._rendezvous_store = serve_store(listen_socket(address, 0), address,
                                                     shared=False)
            return json.dumps({"id": self._handle_id(),
                               "store": _hostport(address, self._rendezvous_store.port),
                               "global_rank": self._global_rank})

        def reconfigure(self, opts: Any) -> Any:
            handles = list(opts.handles)
            missing = sum(1 for h in handles if not h)
            if missing or not handles:
                raise ForeignQuorum(
                    f"{missing or 'all'} of the {len(handles)} participants of the torchft "
                    "quorum came without the process-group handle this torchft exchanges "
                    "through the lighthouse")
            return super().reconfigure(opts)

    return BoundProcessGroupGloo(timeout=timeout)
