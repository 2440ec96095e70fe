"""TCP ports for rendezvous stores: a free one, or a check that a chosen one is free. Torch-free."""

from __future__ import annotations

import errno
import random
import socket

from distrun._spec.errors import UsageError

__all__ = ["bind_error", "check_port", "free_port"]


_CHOSEN_FROM = 20000  # above Ray's worker ports (10002-19999)
_AVOIDED = range(29400, 29600)  # torchrun's and distrun's default store ports


def _ephemeral_floor() -> int:
    """The first port the kernel hands to outgoing connections and ``bind(0)``."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; macOS starts at 49152


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now, from below the kernel's ephemeral range.

    A port the OS picks with ``bind(0)`` comes from the range it also hands to every outgoing
    connection, so between the pick and the store's bind another process's client socket can
    take it (the full suite saw EADDRINUSE for a port picked a minute before its run). Ports
    below the range are only ever taken on purpose, so a free one stays free.
    """
    floor = _ephemeral_floor()
    rng = random.Random()
    for _ in range(100 if floor > _CHOSEN_FROM + 1000 else 0):
        port = rng.randrange(_CHOSEN_FROM, floor)
        if port in _AVOIDED:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))  # no SO_REUSEADDR: a port in TIME_WAIT is not chosen
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def bind_error(host: str, port: int, exc: OSError) -> UsageError:
    """The one line for a store port that cannot be listened on."""
    if exc.errno == errno.EADDRINUSE:
        return UsageError(f"port {port} on {host} is in use (pick another --master-port, or 0 "
                          "for a free one)")
    return UsageError(f"cannot listen on {host}:{port}: {exc.strerror} (check --master-addr "
                      "and --master-port)")


def check_port(host: str, port: int) -> None:
    """Fail with a usage error if ``port`` on ``host`` cannot be bound (node 0 hosts the store).

    As torch's store sockets do, a port whose last connections linger in TIME_WAIT counts as
    free (SO_REUSEADDR); a listener on it does not.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host if host not in ("localhost",) else "127.0.0.1", port))
        except OSError as exc:
            raise bind_error(host, port, exc) from None
