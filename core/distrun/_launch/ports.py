"""TCP ports for rendezvous stores: a free one, or a check that a chosen one is free. Torch-free."""

from __future__ import annotations

import errno
import socket

from distrun._spec.errors import UsageError

__all__ = ["bind_error", "check_port", "free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it)."""
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
