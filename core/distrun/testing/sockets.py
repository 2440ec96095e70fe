"""What a process tree exposes on the network: its listening TCP sockets (Linux ``/proc``).

``ss -ltnp`` answers the same question for every process; this reads ``/proc/net/tcp{,6}`` and
each process's ``/proc/PID/fd`` so a test can ask it of one run's launcher and everything below
(:func:`listeners_while_running`), on a machine whose host name names its outward address, as
a server's does (:func:`on_a_named_host`): there gloo, left to itself, listens on that address.
"""

from __future__ import annotations

import fcntl
import functools
import ipaddress
import os
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from distrun._launch.lifeline import die_with_parent

__all__ = ["HOLD_SCRIPT", "Listener", "exposed", "listeners_of_held_run",
           "listeners_while_running", "listening_sockets", "on_a_named_host", "process_tree"]

_LISTEN = "0A"

#: a torchrun script (``python HOLD_SCRIPT FOLDER``): its group formed and gloo's sockets up,
#: each rank writes FOLDER/ready<RANK>, then waits for FOLDER/go before it ends
HOLD_SCRIPT = """
import os, sys, time
import torch
import torch.distributed as dist

dist.init_process_group()
total = torch.ones(1)
dist.all_reduce(total)
folder = sys.argv[1]
open(os.path.join(folder, "ready%s" % os.environ["RANK"]), "w").close()
while not os.path.exists(os.path.join(folder, "go")):
    time.sleep(0.05)
dist.destroy_process_group()
"""


@dataclass(frozen=True)
class Listener:
    """A listening TCP socket: who holds it and where it accepts connections."""

    pid: int
    command: str
    address: str
    port: int

    @property
    def loopback(self) -> bool:
        ip = ipaddress.ip_address(self.address)
        mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is loopback too
        return (mapped or ip).is_loopback

    def __str__(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port} ({self.command}, pid {self.pid})"


def process_tree(root: int) -> list[int]:
    """``root`` and every live descendant of it (children that changed session included)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


def _address(hex_addr: str) -> str:
    """/proc/net/tcp's address column (host-order 32-bit words in hex) as text."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(words) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, words)


def _listening_inodes() -> dict[str, tuple[str, int]]:
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                rows = fh.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == _LISTEN:
                addr, port = cols[1].split(":")
                out[cols[9]] = (_address(addr), int(port, 16))
    return out


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    except OSError:
        return "?"


def listening_sockets(pids: Iterable[int]) -> list[Listener]:
    """Every listening TCP socket (IPv4 and IPv6) that one of ``pids`` holds open."""
    inodes = _listening_inodes()
    found = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in inodes:
                address, port = inodes[link[8:-1]]
                found.append(Listener(pid, _command(pid), address, port))
    return sorted(set(found), key=lambda s: (s.pid, s.port))


def exposed(root: int) -> tuple[list[Listener], list[Listener]]:
    """(every listener of ``root``'s process tree, those not on a loopback address)."""
    every = listening_sockets(process_tree(root))
    return every, [s for s in every if not s.loopback]


def _outward_ipv4() -> str | None:
    """An IPv4 address of this machine that is not loopback (None when it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                req = fcntl.ioctl(probe.fileno(), 0x8915,  # SIOCGIFADDR
                                  struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            address = socket.inet_ntoa(req[20:24])
            if not ipaddress.ip_address(address).is_loopback:
                return address
    return None


@functools.lru_cache(maxsize=1)
def _unshare() -> list[str] | None:
    """The ``unshare`` command that gives a new mount and UTS namespace here, if any does."""
    exe = shutil.which("unshare")
    if exe is None:
        return None
    for cmd in ([exe, "--mount", "--uts"], [exe, "--map-root-user", "--mount", "--uts"]):
        if subprocess.run([*cmd, "true"], capture_output=True).returncode == 0:
            return cmd
    return None


def on_a_named_host(command: Sequence[str], folder: str | os.PathLike[str]) -> list[str]:
    """``command`` run where the host name resolves to this machine's outward address.

    A mount and UTS namespace with the host name ``distrun-node`` and its own ``/etc/hosts``
    (written into ``folder``) naming the first non-loopback IPv4 address: what a server's
    resolver says, where a test machine's often says 127.0.0.1. The process stays in this
    machine's network namespace, so its sockets are the machine's. Raises ``RuntimeError``
    where that cannot be made (no ``unshare`` allowed, no outward address).
    """
    unshare, address = _unshare(), _outward_ipv4()
    if unshare is None or address is None:
        raise RuntimeError("cannot make a host whose name resolves outward here "
                           f"(unshare usable: {unshare is not None}, outward IPv4: {address})")
    hosts = os.path.join(os.fspath(folder), "hosts")
    with open(hosts, "w") as fh:
        fh.write(f"127.0.0.1 localhost\n::1 localhost\n{address} distrun-node\n")
    script = 'mount --bind "$1" /etc/hosts && hostname distrun-node && shift && exec "$@"'
    return [*unshare, "sh", "-c", script, "sh", hosts, *command]


def listeners_while_running(command: Sequence[str], ready: Callable[[], bool], go: str,
                            *, cwd: str | os.PathLike[str] | None = None,
                            env: Mapping[str, str] | None = None,
                            timeout: float = 240.0) -> tuple[list[Listener], int, str]:
    """Start ``command``, list its tree's listeners once ``ready()``, then create ``go``.

    The command's processes wait for the file ``go`` before they end, so every server they
    started is still up when the list is taken. Returns (listeners, exit code, output). The
    whole tree is killed if the command outlives ``timeout`` seconds (a hang, not a result).
    """
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(list(command), cwd=cwd, env=full_env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True, text=True,
                                preexec_fn=die_with_parent())
        try:
            deadline = time.monotonic() + timeout
            while not ready() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            listeners = listening_sockets(process_tree(proc.pid)) if proc.poll() is None \
                else []
            open(go, "w").close()
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            code = -9
        finally:
            if proc.poll() is None:
                for pid in reversed(process_tree(proc.pid)):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                proc.wait()
        out.seek(0)
        return listeners, code, out.read()


def listeners_of_held_run(command: Sequence[str], hold: str | os.PathLike[str], ranks: int,
                          *, cwd: str | os.PathLike[str] | None = None,
                          env: Mapping[str, str] | None = None,
                          timeout: float = 240.0) -> tuple[list[Listener], int, str]:
    """The listeners of a run whose ``ranks`` ranks hold as :data:`HOLD_SCRIPT`'s do.

    ``command`` runs on a named host (:func:`on_a_named_host`) where one can be made, else as
    it is (the stores are still checked; where gloo listens then depends on this machine's
    resolver). ``hold`` is the folder the ranks signal in; it must exist.
    """
    folder = os.fspath(hold)
    try:
        command = on_a_named_host(command, folder)
    except RuntimeError:
        command = list(command)
    return listeners_while_running(
        command, lambda: all(os.path.exists(os.path.join(folder, f"ready{r}"))
                             for r in range(ranks)),
        os.path.join(folder, "go"), cwd=cwd, env=env, timeout=timeout)
