"""Where a run's servers listen: the one place that decides it (torch-free).

A run starts servers that take connections with no authentication: torch's TCPStore (the
rendezvous store on ``MASTER_PORT``, and the elastic agent's), gloo's pair sockets, RPC's
tensorpipe listeners. Binding is the only control they have. :func:`bind_address` gives the
address they all bind; the launcher hands it to its workers as :data:`BIND_ENV`, with the
interface variables gloo and tensorpipe read (:func:`server_env`), and binds the store's
socket itself (:func:`listen_socket`): torch's TCPStore takes no bind address, only a socket
already bound (``master_listen_fd``), which the worker that hosts the store receives as
:data:`STORE_FD_ENV` (:mod:`distrun._worker.store`).

One node: 127.0.0.1 (or the address ``--master-addr`` gives). Several nodes: this node's
address on the network the nodes share: ``--local-addr`` when given, else the address of this
host that traffic to rank 0's host (``--master-addr``, the ``--rdzv-endpoint`` host) leaves
from, a routing lookup (loopback when rank 0's address is a loopback one: every node is on
this machine). That address is also the one the node announces: gloo takes its interface
(``GLOO_SOCKET_IFNAME``), and torch's c10d rendezvous its address (``local_addr``). So a host
whose own name resolves to 127.0.1.1 (Debian's installer writes that line into /etc/hosts),
which gloo would otherwise announce, and which no other node reaches, runs as any other: the
classic multi-node hang at init does not happen. ``--local-addr`` (torchrun's flag) chooses
another address; it must be one of this host's.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping

from distrun._launch.ports import bind_error
from distrun._spec.errors import UsageError

__all__ = ["BIND_ENV", "LOOPBACK", "STORE_FD_ENV", "addresses_of", "bind_address", "local_address",
           "interface_addresses", "interface_of", "listen_socket", "loopback_interface",
           "resolve", "route_source", "server_env"]

LOOPBACK = "127.0.0.1"
#: the address a worker's own servers bind (unset: torch's defaults)
BIND_ENV = "DISTRUN_BIND_ADDRESS"
#: in the worker that hosts the rendezvous store: the listening socket the launcher bound
STORE_FD_ENV = "DISTRUN_STORE_FD"
#: the variables that choose the interface gloo's and tensorpipe's sockets listen on
INTERFACE_VARS = ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME")
_IFF_LOOPBACK = 0x8
_SIOCGIFADDR = 0x8915


def bind_address(nnodes: int, master_addr: str = LOOPBACK, local_addr: str = "") -> str:
    """The address this node's servers bind and announce, in a run of ``nnodes`` nodes whose
    rank 0 is at ``master_addr`` (see the module docstring); a one-line :class:`UsageError`
    when there is none."""
    if local_addr:
        return addresses_of(local_addr, "--local-addr")
    if master_addr in ("", "localhost"):
        return LOOPBACK
    if nnodes == 1:
        return addresses_of(master_addr, "--master-addr")
    master = resolve(master_addr)
    if master is None:
        raise UsageError(f"{master_addr} (rank 0's host) does not resolve on this host: give "
                         "its address (--master-addr, or the --rdzv-endpoint host)")
    if ipaddress.ip_address(master).is_loopback:
        return master  # every node on this machine
    source = route_source(master)
    if source is None:
        raise UsageError(f"rank 0's host {master_addr} ({master}) is not reachable from this "
                         "host (no route): check the address, or give this node's address "
                         "with --local-addr")
    return source


def resolve(host: str) -> str | None:
    """``host``'s address here (an address is itself; a name its IPv4 address), None when it
    does not resolve."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        return socket.gethostbyname(host)
    except OSError:
        return None


def local_address(host: str) -> str | None:
    """``host``'s address when one of this machine's interfaces has it (127.0.0.1 is the
    loopback's), else None: another host's, or a name that does not resolve."""
    address = resolve(host)
    return address if address in interface_addresses().values() else None


def addresses_of(host: str, flag: str) -> str:
    """The address ``host`` (an address or a name) gives on this machine, which must be one of
    this host's (or a loopback one): what a server of this node can bind."""
    address = resolve(host)
    if address is not None and ipaddress.ip_address(address).is_loopback:
        return address
    mine = interface_addresses()
    if address is None or address not in mine.values():
        have = ", ".join(f"{a} ({i})" for i, a in mine.items())
        what = f"resolves to {address}, which" if address and address != host else "it"
        if address is None:
            what = "does not resolve here, so it"
        raise UsageError(f"{flag} {host}: {what} is not an address of this host (its "
                         f"addresses: {have or 'none'})")
    return address


def route_source(host: str) -> str | None:
    """The address of this host that traffic to ``host`` leaves from (a routing lookup: a UDP
    socket is connected, nothing is sent); None when ``host`` is unreachable."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return str(probe.getsockname()[0])
    except OSError:
        return None


def interface_addresses() -> dict[str, str]:
    """Each up interface's (primary) IPv4 address: ``{"lo": "127.0.0.1", "eth0": ...}``."""
    import fcntl
    import struct

    out = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                req = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR,
                                  struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it (or it is down)
                continue
            out[name] = socket.inet_ntoa(req[20:24])
    return out


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
    if ipaddress.ip_address(address).is_loopback:
        return loopback_interface()
    return next((name for name, a in interface_addresses().items() if a == address), None)


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
