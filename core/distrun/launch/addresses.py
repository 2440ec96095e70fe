"""Which address of this node the other nodes reach, and telling gloo to use it. Torch-free.

gloo (torch's CPU backend) picks the address it announces to the other ranks from this host's
name: it binds what ``gethostname()`` resolves to, and falls back to the loopback when that
fails. A host whose own name resolves to 127.0.1.1 (Debian's installer writes that line into
/etc/hosts) therefore announces an address no other node can reach, and the run hangs at init
until the collective timeout: the classic multi-node hang. torchrun's ``--local-addr`` names
the address to use instead.

:func:`local_interface` checks ``--local-addr`` as the command is read (before anything is
written); :func:`node_network` is called by every launcher before it starts workers:
with ``--local-addr`` it checks the address is this host's and hands gloo its interface
(``GLOO_SOCKET_IFNAME``); without it, a host name that resolves to no usable address of this
host is an error of one line that names the fix, rather than a hang.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from collections.abc import Mapping

from distrun.spec.errors import UsageError

__all__ = ["interface_addresses", "local_interface", "node_network", "route_source"]

GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915


def interface_addresses() -> dict[str, str]:
    """Each up interface's (primary) IPv4 address: ``{"lo": "127.0.0.1", "eth0": ...}``."""
    out = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                out[name] = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])
            except OSError:  # no IPv4 address (or down)
                continue
    return out


def route_source(host: str) -> str | None:
    """The address of this host that traffic to ``host`` leaves from (a routing lookup: a UDP
    socket is connected, nothing is sent); None when ``host`` is unknown or unreachable."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return str(s.getsockname()[0])
    except OSError:
        return None


def _resolve(host: str) -> str | None:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return None


def _loopback(address: str | None) -> bool:
    return address is not None and ipaddress.ip_address(address).is_loopback


def local_interface(local_addr: str) -> str:
    """The interface holding ``--local-addr`` (an address or a name); a one-line
    :class:`UsageError` when no interface of this host has it."""
    address = _resolve(local_addr)
    mine = interface_addresses()
    iface = next((i for i, a in mine.items() if a == address), None)
    if iface is None:
        have = ", ".join(f"{a} ({i})" for i, a in mine.items())
        what = f"resolves to {address}, which" if address and address != local_addr else "it"
        raise UsageError(f"--local-addr {local_addr}: {what} is not an address of this host "
                         f"(its addresses: {have or 'none'})")
    return iface


def node_network(*, local_addr: str, rendezvous_host: str, multi_node: bool,
                 environ: Mapping[str, str]) -> dict[str, str]:
    """Variables this node's workers need so that the other nodes reach them; a
    :class:`UsageError` (one line, the fix in it) when they could not.

    ``rendezvous_host`` is ``--master-addr`` or the ``--rdzv-endpoint`` host: when it is a
    loopback address, every node runs on this machine and any address works.
    """
    if local_addr:
        iface = local_interface(local_addr)
        return {} if GLOO_IFNAME in environ else {GLOO_IFNAME: iface}
    if not multi_node or GLOO_IFNAME in environ:
        return {}
    rendezvous = _resolve(rendezvous_host)
    if rendezvous is None or _loopback(rendezvous):
        return {}  # every node on this machine, or a name only the launcher can judge later
    name = socket.gethostname()
    own = _resolve(name)
    if own is not None and not _loopback(own) and own in interface_addresses().values():
        return {}
    here = route_source(rendezvous) or "ADDRESS"
    said = f"resolves to {own}" if own else "does not resolve"
    where = "the loopback" if _loopback(own) else "not an address of this host" if own else ""
    raise UsageError(
        f"this host's name {name!r} {said}{f' ({where})' if where else ''}, so the other "
        f"nodes could not reach its ranks and the run would hang at init: pass --local-addr "
        f"{here} (this node's address on the network the nodes share), or map {name} to it "
        "in /etc/hosts")
