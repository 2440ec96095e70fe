"""A TCPStore served on a socket bound by distrun, so it listens only where the run allows.

torch's TCPStore binds every interface and takes no address to bind; what it does take is a
listening socket (``master_listen_fd``). The launcher binds the rendezvous port on the run's
bind address (:mod:`distrun.launch.binding`) and hands the socket to the worker that hosts the
store; there :func:`host_launcher_store` serves a store on it as soon as torch is imported.

That store is *multi-tenant*: torch keeps one server per port in a process, and every store
torch itself makes for a rendezvous (``init_process_group``'s env:// and tcp://, the elastic
agent's c10d and static rendezvous) asks for a multi-tenant one, so on this port it gets this
server instead of binding its own. A plain ``init_process_group()`` therefore runs unchanged
and its store listens on the launcher's socket. The server lives as long as the process, as
the store torchrun's agent hosts does: a group destroyed and made again meets on it again.

Importing this module does not import torch.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import sys
from typing import Any

from distrun.launch.binding import STORE_FD_ENV

__all__ = ["host_launcher_store", "serve_store"]

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


def host_launcher_store() -> None:
    """In the worker the launcher gave the store's socket: serve the store once torch loads.

    Not before: a script that never imports torch pays nothing. A failure to serve it is one
    line on stderr, and the socket is closed so the script's own store can bind the port.
    """
    value = os.environ.pop(STORE_FD_ENV, None)  # not for this worker's own children
    if value is None:
        return
    fd = int(value)
    os.set_inheritable(fd, False)
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")

    def serve() -> None:
        try:
            serve_store(fd, host)
        except Exception as exc:  # noqa: BLE001 - the run may still work with torch's own
            with contextlib.suppress(OSError):
                os.close(fd)
            print(f"distrun: cannot serve the rendezvous store on the launcher's socket "
                  f"({exc}); torch binds its own", file=sys.stderr, flush=True)

    if "torch" in sys.modules:
        serve()
    else:
        sys.meta_path.insert(0, _AfterImport("torch", serve))
