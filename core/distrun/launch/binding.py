"""Where a run's servers listen: the one place that decides it (torch-free).

A run starts servers that take connections with no authentication: torch's TCPStore (the
rendezvous store on ``MASTER_PORT``, and the elastic agent's), gloo's pair sockets, RPC's
tensorpipe listeners. Binding is the only control they have. :func:`bind_address` gives the
address they all bind; the launcher hands it to its workers as :data:`BIND_ENV`, with the
interface variables gloo and tensorpipe read (:func:`server_env`), and binds the store's
socket itself (:func:`listen_socket`): torch's TCPStore takes no bind address, only a socket
already bound (``master_listen_fd``), which the worker that hosts the store receives as
:data:`STORE_FD_ENV` (:mod:`distrun.train.store_host`).

One node: 127.0.0.1 (or the address ``--master-addr`` gives). Several nodes: loopback when
rank 0's address is loopback (every node is on this machine), else ``None`` for now, which keeps
torch's own behaviour (its stores listen on every interface, gloo on the address the host name
resolves to); binding the address the user gave there is a change of this one function.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping

from distrun.launch.ports import bind_error
from distrun.spec.errors import UsageError

__all__ = ["BIND_ENV", "LOOPBACK", "STORE_FD_ENV", "bind_address", "interface_of",
           "listen_socket", "loopback_interface", "server_env"]

LOOPBACK = "127.0.0.1"
#: the address a worker's own servers bind (unset: torch's defaults)
BIND_ENV = "DISTRUN_BIND_ADDRESS"
#: in the worker that hosts the rendezvous store: the listening socket the launcher bound
STORE_FD_ENV = "DISTRUN_STORE_FD"
#: the variables that choose the interface gloo's and tensorpipe's sockets listen on
INTERFACE_VARS = ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME")
_IFF_LOOPBACK = 0x8
_SIOCGIFADDR = 0x8915


def bind_address(nnodes: int, master_addr: str = LOOPBACK) -> str | None:
    """The address every server of a run of ``nnodes`` nodes binds (None: torch's default).

    One node: the loopback address, or the address ``--master-addr`` names when the user gave
    another one (never every interface). Several nodes: the loopback address when rank 0's is
    one (they all run on this machine), else None for now.
    """
    if master_addr in ("", "localhost"):
        return LOOPBACK
    if nnodes != 1:
        try:
            return master_addr if ipaddress.ip_address(master_addr).is_loopback else None
        except ValueError:
            return None
    try:
        return str(ipaddress.ip_address(master_addr))
    except ValueError:
        pass
    try:  # a host name: the address it names here
        return str(socket.getaddrinfo(master_addr, None, type=socket.SOCK_STREAM)[0][4][0])
    except (OSError, IndexError):
        raise UsageError(f"--master-addr {master_addr} does not resolve on this machine (give "
                         f"an address, or leave the default {LOOPBACK} on one node)") from None


def loopback_interface() -> str:
    """The name of this machine's loopback interface (``lo`` on Linux)."""
    try:
        for name in sorted(os.listdir("/sys/class/net")):
            with open(f"/sys/class/net/{name}/flags") as fh:
                if int(fh.read().strip(), 16) & _IFF_LOOPBACK:
                    return name
    except (OSError, ValueError):
        pass
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") \
        else []
    return next((n for n in ("lo", "lo0") if n in names), "lo")


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds ``address`` (None when none here does)."""
    ip = ipaddress.ip_address(address)
    if ip.is_loopback:
        return loopback_interface()
    if ip.version != 4 or not hasattr(socket, "if_nameindex"):
        return None
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                req = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR,
                                  struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on it
            if socket.inet_ntoa(req[20:24]) == address:
                return name
    return None


def server_env(address: str | None, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables that make a worker's servers bind ``address``.

    Interface variables the user set are kept: they chose where gloo listens.
    """
    if address is None:
        return {}
    env = {BIND_ENV: address}
    interface = interface_of(address)
    if interface is not None:
        env.update({var: interface for var in INTERFACE_VARS if not environ.get(var)})
    return env


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` (0: a free port), for a store to serve on.

    A port already taken is a usage error. The socket is inheritable: pass it to the worker
    that hosts the store (``pass_fds``) and close this copy once it has started.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # as torch's own store sockets: a port whose last connections linger in TIME_WAIT is
        # free (a listener on it is still refused)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        raise bind_error(host, port, exc) from None
    sock.set_inheritable(True)
    return sock
