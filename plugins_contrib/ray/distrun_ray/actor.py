"""The Ray actor that hosts one rank: it starts the worker process on its node and relays it.

Imported by the launcher and by Ray's worker processes (not by the entry point). The worker is
a plain subprocess with torchrun's variables, exactly as the local launcher starts it, so a
torchrun script or a distrun task runs unchanged; the actor only owns it, relays its lines and
stops it. The subprocess dies with the actor (PR_SET_PDEATHSIG on Linux).
"""

from __future__ import annotations

import codecs
import collections
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO

__all__ = ["RankHost"]

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: the actor's stop() still ends it
        pass


class RankHost:
    """One rank's host on a Ray node (wrapped with ``ray.remote`` by the launcher)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.lines: collections.deque[tuple[str, str]] = collections.deque()
        self.readers: list[threading.Thread] = []
        self.store: socket.socket | None = None  # rank 0's store socket, until start()

    def node(self) -> tuple[str, str, str]:
        """(IP address, Ray node id, host name) of the node this actor was placed on."""
        import ray

        return (ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id(),
                socket.gethostname())

    def store_port(self, bind: str | None) -> int:
        """The port of rank 0's store on this node.

        With a bind address the socket is bound here, on that address only, and kept for the
        worker :meth:`start` starts next, which serves the store on it (torch's own would listen
        on every interface). Without one: a port free on this node's address.
        """
        import ray

        from distrun.plugin import free_port, listen_socket

        if bind is None:
            return free_port(ray.util.get_node_ip_address())
        self.store = listen_socket(bind, 0)
        return self.store.getsockname()[1]

    def start(self, command: Sequence[str], env: Mapping[str, str], cwd: str,
              bind: str | None = None) -> int:
        """Start the worker with this node's Python; ``env`` is added to the actor's own.

        ``bind``: the address the worker's servers listen on (gloo's and tensorpipe's interface
        is looked up on this node).
        """
        from distrun.plugin import STORE_FD_ENV, server_env

        full_env = dict(os.environ)
        full_env.update(env)
        full_env.update(server_env(bind, full_env))
        fds: tuple[int, ...] = ()
        if self.store is not None:
            full_env[STORE_FD_ENV] = str(self.store.fileno())
            fds = (self.store.fileno(),)
        argv = [sys.executable, *command[1:]]  # the launcher's interpreter path may differ here
        self.lines.clear()
        try:
            self.proc = subprocess.Popen(
                argv, env=full_env, cwd=cwd if os.path.isdir(cwd) else None,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0,
                preexec_fn=_die_with_parent, pass_fds=fds,
            )
        finally:
            if self.store is not None:
                self.store.close()  # the worker holds it now
                self.store = None
        self.readers = [threading.Thread(target=self._read, args=(name, stream), daemon=True)
                        for name, stream in (("out", self.proc.stdout), ("err", self.proc.stderr))]
        for t in self.readers:
            t.start()
        return self.proc.pid

    def _read(self, name: str, stream: IO[bytes]) -> None:
        """Queue the worker's output as it comes (pieces of lines too: a ``\\r`` redraw)."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        while chunk := stream.read(1 << 16):
            self.lines.append((name, decoder.decode(chunk)))
        if rest := decoder.decode(b"", final=True):
            self.lines.append((name, rest))

    def poll(self) -> tuple[list[tuple[str, str]], int | None]:
        """New output since the last poll, and the exit code once the worker is done."""
        code = None if self.proc is None else self.proc.poll()
        if code is not None:
            for t in self.readers:  # all lines are read before the exit is reported
                t.join(timeout=5.0)
        out = []
        while self.lines:
            out.append(self.lines.popleft())
        return out, code

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the worker (and its children)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signum)
            except ProcessLookupError:
                pass

    def stop(self, grace: float) -> int | None:
        """SIGTERM, then SIGKILL after ``grace`` seconds; the exit code."""
        if self.proc is None:
            return None
        self.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        self.signal(signal.SIGKILL)
        return self.proc.wait()
