"""TCPStores served on a socket bound by distrun, so they listen only where the run allows.

torch's TCPStore binds every interface and takes no address to bind; what it does take is a
listening socket (``master_listen_fd``). The launcher binds the rendezvous port on the run's
bind address (:mod:`distrun._launch.binding`) and hands the socket to the worker that hosts the
store, rank 0. There :func:`host_launcher_store` keeps the socket for the life of the process
(the port stays the run's) and, once torch is imported, has every store torch makes for a
rendezvous on that port (``init_process_group``'s env:// and tcp://) served on a duplicate of
it: the server torch would start is started the same way (multi-tenant, a new one once the
last group on it is gone, so a group destroyed and made again meets on an empty store), only
on the launcher's socket instead of every interface. A plain ``init_process_group()`` runs
unchanged.

:func:`serve_store` serves one store on a given socket (the elastic agent's stores).
Importing this module does not import torch.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import socket
import sys
from typing import Any

from distrun._launch.binding import STORE_FD_ENV
from distrun._launch.lifeline import die_with_launcher

__all__ = ["host_launcher_store", "join_launcher", "serve_store"]

#: the stores this process serves: torch's per-port server lives while one of them does
_served: list[Any] = []


def serve_store(sock: socket.socket | int, host: str = "127.0.0.1", *,
                shared: bool = True) -> Any:
    """Serve a ``TCPStore`` on a listening socket (or its descriptor), which it takes over.

    ``shared``: multi-tenant and served until the process ends, so the stores torch makes for
    a rendezvous on this port use it. Otherwise a store of its own, closed with its last
    reference. ``host`` is the address this process's own client connects to.
    """
    from torch.distributed import TCPStore

    with socket.socket(fileno=sock if isinstance(sock, int) else sock.detach()) as wrapper:
        port = wrapper.getsockname()[1]
        fd = wrapper.detach()
    store = TCPStore(host, port, None, is_master=True, wait_for_workers=False,
                     multi_tenant=shared, master_listen_fd=fd,
                     use_libuv=os.environ.get("USE_LIBUV", "1") == "1")
    if shared:
        _served.append(store)
    return store


class _AfterImport:
    """Call ``then()`` once module ``name`` has been imported (by whoever imports it).

    A meta path finder (``find_spec`` is all one needs; importlib.abc costs 20 ms to import).
    """

    def __init__(self, name: str, then: Any) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module, then = spec.loader.exec_module, self.then

        def exec_then(module: Any) -> None:
            exec_module(module)
            then()

        spec.loader.exec_module = exec_then  # type: ignore[method-assign]
        return spec


def _serve_rendezvous_on(fd: int) -> None:
    """Have torch's rendezvous stores on ``fd``'s port served on ``fd`` (rank 0 only)."""
    from torch.distributed import TCPStore

    # the module (torch.distributed.rendezvous as an attribute is the function of that name)
    rdzv: Any = importlib.import_module("torch.distributed.rendezvous")

    with socket.socket(fileno=os.dup(fd)) as probe:
        ours = probe.getsockname()[1]
    create = rdzv._create_c10d_store  # what env:// and tcp:// call for their store

    # torch's signature, names included
    def create_on_launcher_socket(hostname: str, port: int, rank: int, world_size: int,
                                  timeout: Any, use_libuv: bool = True) -> Any:
        if port != ours or rank != 0 or rdzv._torchelastic_use_agent_store():
            return create(hostname, port, rank, world_size, timeout, use_libuv)
        # torch's own call with the socket added; on a live server of this port (another
        # group still on it) torch reuses that one and leaves this duplicate unused, open
        return TCPStore(host_name=hostname, port=port, world_size=world_size, is_master=True,
                        timeout=timeout, multi_tenant=True, use_libuv=use_libuv,
                        master_listen_fd=os.dup(fd))

    rdzv._create_c10d_store = create_on_launcher_socket


def join_launcher() -> None:
    """What a worker does first, as every distrun worker does: ask to be killed when its
    launcher dies, and, as rank 0, serve the rendezvous store on the socket the launcher bound
    (for a launcher that forks its ranks itself, such as the notebook launcher)."""
    die_with_launcher()
    host_launcher_store()


def host_launcher_store() -> None:
    """In the worker the launcher gave the store's socket: serve its stores on it.

    Set up once torch is imported: a script that never imports torch pays nothing. A failure
    is one line on stderr, and the socket is closed so torch's own store can bind the port.
    """
    value = os.environ.pop(STORE_FD_ENV, None)  # not for this worker's own children
    if value is None:
        return
    fd = int(value)
    os.set_inheritable(fd, False)

    def serve() -> None:
        try:
            _serve_rendezvous_on(fd)
        except Exception as exc:  # noqa: BLE001 - the run may still work with torch's own
            with contextlib.suppress(OSError):
                os.close(fd)
            print(f"distrun: cannot serve the rendezvous store on the launcher's socket "
                  f"({exc}); torch binds its own", file=sys.stderr, flush=True)

    if "torch" in sys.modules:
        serve()
    else:
        sys.meta_path.insert(0, _AfterImport("torch", serve))
