"""A throwaway Ray head on 127.0.0.1 for tests and benchmarks, stopped with all it started.

``ray stop`` would end every Ray process of the machine; this one ends only what it started:
SIGTERM to ``ray start --block`` (which stops its GCS, raylet and workers in order, ~2 s),
then SIGKILL to whatever of its process tree is still alive. A SIGTERM to the whole group at
once is slower: the GCS and the autoscaler monitor then wait for each other for ~15 s.

The head also ends when the process that started it does, however that ends (a test run
killed by its timeout, kill -9): ``ray start`` runs under :mod:`distrun.launch.reaper`, which
the kernel signals at its parent's death and which then stops the head the same way, every
process Ray started included (they would otherwise be reparented to init and run on), and
removes its session folder.
Ray binds to the node address, so ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` keeps the node on
the loopback address and every port on 127.0.0.1.
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
from types import TracebackType

from distrun.plugin import free_port, pid_alive, reaped

__all__ = ["LocalRayCluster"]


class LocalRayCluster:
    """``with LocalRayCluster(num_cpus=4) as address: ...`` (address is ``127.0.0.1:PORT``)."""

    def __init__(self, num_cpus: int = 4, start_timeout: float = 120.0,
                 env: dict[str, str] | None = None) -> None:
        self.num_cpus = num_cpus
        self.start_timeout = start_timeout
        self.env = env or {}
        self.proc: subprocess.Popen | None = None
        self.temp_dir = ""
        self.address = ""

    def start(self) -> str:
        port = free_port()
        # Short path: Ray's unix socket paths must stay under ~107 characters.
        self.temp_dir = tempfile.mkdtemp(prefix="dray")
        ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
        command = [ray_cli if os.path.exists(ray_cli) else "ray", "start", "--head", "--block",
                   "--node-ip-address", "127.0.0.1", "--port", str(port),
                   "--num-cpus", str(self.num_cpus), "--include-dashboard", "false",
                   "--disable-usage-stats", "--temp-dir", self.temp_dir,
                   "--dashboard-agent-listen-port", str(free_port()),
                   # the minimal dashboard head still starts; keep it off the fixed port 8265
                   "--dashboard-port", str(free_port()),
                   "--object-store-memory", str(100 * 1024 * 1024)]
        if importlib.util.find_spec("grpc") is not None:
            # Ray's client server (only with ray[client]) would take the fixed port 10001.
            command += ["--ray-client-server-port", str(free_port())]
        env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", **self.env}
        env.pop("RAY_ADDRESS", None)
        self.log = open(os.path.join(self.temp_dir, "head.log"), "w")  # noqa: SIM115
        self.proc = subprocess.Popen(reaped(command, grace=5.0, remove=self.temp_dir),
                                     env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.address = f"127.0.0.1:{port}"
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
        raise RuntimeError(f"the Ray head did not start within {self.start_timeout:g}s:\n{tail}")

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
                left = {pid for pid in started if pid_alive(pid)} | self.processes()
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
