"""A throwaway Ray node for tests and benchmarks, stopped with all it started.

By default a head on 127.0.0.1. ``node_ip`` puts the node on another address of this host,
``join`` makes it a worker node of that head (``ray start --address``), and ``wrap`` runs
``ray start`` through a command prefix, such as a testbed host's
(:meth:`distrun.testing.hosts.Host.command`): a head in one network namespace and a worker in
another make a two-node cluster on one machine.

``ray stop`` would end every Ray process of the machine; this one ends only what it started:
SIGTERM to ``ray start --block`` (which stops its GCS, raylet and workers in order, ~2 s),
then SIGKILL to whatever of its process tree is still alive. A SIGTERM to the whole group at
once is slower: the GCS and the autoscaler monitor then wait for each other for ~15 s.

The head also ends when the process that started it does, however that ends (a test run
killed by its timeout, kill -9): ``ray start`` runs under :func:`distrun.plugin.reaped`, which
the kernel signals at its parent's death and which then stops the head the same way, every
process Ray started included (they would otherwise be reparented to init and run on), and
removes its session folder.
On 127.0.0.1, ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` keeps the node on the loopback address
(Ray otherwise rewrites it to the machine's outward one). What listens where: the ports Ray lets
one choose are given (no dashboard, the dashboard agent's and the client server's ports free
ones, not Ray's fixed 8265 and 10001); the runtime-env agent and the client server listen on the
node's address; Ray 2.60's GCS and raylet (node manager, object manager) listen on every
interface whatever one says (``--node-ip-address`` is only what they announce).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from types import TracebackType

from distrun.plugin import ProcessId, free_port, reaped

__all__ = ["LocalRayCluster"]


class LocalRayCluster:
    """``with LocalRayCluster(num_cpus=4) as address: ...`` (address is ``127.0.0.1:PORT``).

    ``node_ip``: the node's address (the head's GCS port is on it). ``join``: the address of a
    running head, ``HOST:PORT``, to start a worker node of that cluster instead of a head.
    ``wrap``: turns the ``ray start`` command line into the one that runs it (e.g. on a testbed
    host); it must ``exec`` the command, so that the process started is the node's leader.
    """

    def __init__(self, num_cpus: int = 4, start_timeout: float = 120.0,
                 env: dict[str, str] | None = None, *, node_ip: str = "127.0.0.1",
                 join: str | None = None,
                 wrap: Callable[[list[str]], list[str]] | None = None) -> None:
        self.num_cpus = num_cpus
        self.start_timeout = start_timeout
        self.env = env or {}
        self.node_ip = node_ip
        self.join = join
        self.wrap = wrap
        self.proc: subprocess.Popen | None = None
        self.temp_dir = ""
        self.address = ""

    def start(self) -> str:
        """Start the node; the cluster's address (the head's ``HOST:PORT``)."""
        port = free_port()
        # Short path: Ray's unix socket paths must stay under ~107 characters.
        self.temp_dir = tempfile.mkdtemp(prefix="dray")
        ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
        command = [ray_cli if os.path.exists(ray_cli) else "ray", "start", "--block",
                   "--node-ip-address", self.node_ip, "--num-cpus", str(self.num_cpus),
                   "--disable-usage-stats", "--temp-dir", self.temp_dir,
                   "--dashboard-agent-listen-port", str(free_port()),
                   "--object-store-memory", str(100 * 1024 * 1024)]
        if self.join:
            command += ["--address", self.join]
        else:
            command += ["--head", "--port", str(port), "--include-dashboard", "false",
                        # the minimal dashboard head still starts; keep it off the fixed 8265
                        "--dashboard-port", str(free_port())]
            if importlib.util.find_spec("grpc") is not None:
                # Ray's client server (only with ray[client]) would take the fixed port 10001.
                command += ["--ray-client-server-port", str(free_port())]
        loopback = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"} if self.node_ip == "127.0.0.1" else {}
        env = {**os.environ, **loopback, **self.env}
        env.pop("RAY_ADDRESS", None)
        self.log = open(os.path.join(self.temp_dir, "head.log"), "w")  # noqa: SIM115
        argv = reaped(command, grace=5.0, remove=self.temp_dir)
        self.proc = subprocess.Popen(self.wrap(argv) if self.wrap else argv,
                                     env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.address = self.join or f"{self.node_ip}:{port}"
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code, tail = self.proc.returncode, self._log_tail()
                self.stop()
                raise RuntimeError(f"ray start exited with {code}:\n{tail}")
            if self._started():
                return self.address
            time.sleep(0.5)
        tail = self._log_tail()
        self.stop()
        raise RuntimeError(f"the Ray node did not start within {self.start_timeout:g}s:\n{tail}")

    def _log_tail(self, lines: int = 20) -> str:
        with open(os.path.join(self.temp_dir, "head.log")) as fh:
            return "".join(fh.readlines()[-lines:])

    def _started(self) -> bool:
        with open(os.path.join(self.temp_dir, "head.log")) as fh:
            return "Ray runtime started" in fh.read()

    def processes(self) -> set[int]:
        """Live processes of the head: its process group and every descendant (Ray workers)."""
        if self.proc is None:
            return set()
        table = _process_table()
        found = {pid for pid, (_, pgid, state) in table.items()
                 if pgid == self.proc.pid and state != "Z"}
        grew = True
        while grew:
            more = {pid for pid, (ppid, _, state) in table.items()
                    if ppid in found and pid not in found and state != "Z"}
            found |= more
            grew = bool(more)
        return found

    def stop(self, grace: float = 10.0) -> set[int]:
        """End the head and everything it started, then remove its files.

        Returns the processes of the head still alive afterwards: none, unless the kernel
        could not end one (tests assert the set is empty).
        """
        left: set[int] = set()
        if self.proc is not None:
            started = self.processes()
            leader = self.proc
            try:
                leader.send_signal(signal.SIGTERM)
                leader.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
            for pid in started | self.processes():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            leader.wait()
            deadline = time.monotonic() + 10.0
            while True:
                left = {pid for pid in started if ProcessId(pid).alive()} | self.processes()
                if not left or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            self.proc = None
            self.log.close()
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        return left

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def _process_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, process group, state letter) for every process, from /proc."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        table[int(name)] = (int(fields[1]), int(fields[2]), fields[0])
    return table
