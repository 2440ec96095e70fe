"""TCP ports for rendezvous stores: a free one, or a check that a chosen one is free. Torch-free."""

from __future__ import annotations

import socket

from distrun.spec.errors import UsageError

__all__ = ["check_port", "free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port(host: str, port: int) -> None:
    """Fail with a usage error if ``port`` on ``host`` cannot be bound (node 0 hosts the store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host if host not in ("localhost",) else "127.0.0.1", port))
        except OSError:
            raise UsageError(
                f"port {port} on {host} is in use (pick another --master-port, or 0 for a free one)"
            ) from None
