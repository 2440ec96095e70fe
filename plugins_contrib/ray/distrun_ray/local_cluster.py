"""A throwaway Ray head on 127.0.0.1 for tests and benchmarks, stopped by its process group.

``ray stop`` would end every Ray process of the machine; this one ends only what it started.
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

from distrun.launch.ports import free_port

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
                   "--object-store-memory", str(100 * 1024 * 1024)]
        if importlib.util.find_spec("grpc") is not None:
            # Ray's client server (only with ray[client]) would take the fixed port 10001.
            command += ["--ray-client-server-port", str(free_port())]
        env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", **self.env}
        env.pop("RAY_ADDRESS", None)
        self.log = open(os.path.join(self.temp_dir, "head.log"), "w")  # noqa: SIM115
        self.proc = subprocess.Popen(command, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
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

    def stop(self, grace: float = 15.0) -> None:
        """End the head and everything it started (one process group), then its files."""
        if self.proc is not None:
            pgid = self.proc.pid  # start_new_session: the group id is the leader's pid
            for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(pgid, sig)
                except ProcessLookupError:
                    break
                deadline = time.monotonic() + wait
                while time.monotonic() < deadline and _group_alive(pgid):
                    time.sleep(0.2)
            self.proc.wait()
            self.proc = None
            self.log.close()
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    # zombies still count for killpg; look for a live member
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False
