"""The core's local launcher: start this node's workers with torchrun's environment.

Workers get exactly the variables torchrun sets, so a torchrun script runs unchanged. Their
output is relayed line by line (``--tee`` prefixes the rank); Ctrl-C and SIGTERM are forwarded
to every worker; when one fails the others are stopped and its last lines are shown.
Multi-node static runs rendezvous through torch's env:// TCPStore on ``MASTER_ADDR``.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, cast

from distrun.config.run_config import RunConfig
from distrun.launch.exits import exit_code
from distrun.launch.lifeline import LAUNCHER_PID_ENV
from distrun.launch.ports import check_port, free_port
from distrun.launch.relay import Relay, new_tail, report_failure
from distrun.spec.errors import UsageError

__all__ = ["WorkerGroup", "launch_local", "torchrun_env"]

#: seconds a worker has, after SIGTERM, to save and exit before SIGKILL
STOP_GRACE = 30.0


def resolve_nproc(value: Any) -> int:
    if value != "auto":
        return int(value)
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
    except ImportError:  # pragma: no cover
        pass
    return os.cpu_count() or 1


def torchrun_env(*, rank: int, local_rank: int, world_size: int, local_world_size: int,
                 node_rank: int, nnodes: int, master_addr: str, master_port: int,
                 run_id: str, restart_count: int = 0, max_restarts: int = 0) -> dict[str, str]:
    """The variables torchrun gives a worker (see torch.distributed.run)."""
    env = {
        "RANK": rank, "LOCAL_RANK": local_rank, "WORLD_SIZE": world_size,
        "LOCAL_WORLD_SIZE": local_world_size, "GROUP_RANK": node_rank,
        "GROUP_WORLD_SIZE": nnodes, "ROLE_RANK": rank, "ROLE_WORLD_SIZE": world_size,
        "ROLE_NAME": "default", "MASTER_ADDR": master_addr, "MASTER_PORT": master_port,
        "TORCHELASTIC_RESTART_COUNT": restart_count, "TORCHELASTIC_MAX_RESTARTS": max_restarts,
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "False",
    }
    return {k: str(v) for k, v in env.items()}


@dataclass
class _Worker:
    rank: int
    proc: subprocess.Popen
    tail: collections.deque[str] = field(default_factory=new_tail)
    threads: list[threading.Thread] = field(default_factory=list)
    log: IO[str] | None = None  # run_dir/logs/rank<N>.log, appended by both relays


class WorkerGroup:
    """This node's worker processes: start, relay output, forward signals, wait, stop."""

    def __init__(self, command: Sequence[str], envs: Sequence[Mapping[str, str]],
                 ranks: Sequence[int], tee: bool = False, log_dir: str | None = None) -> None:
        self.command = list(command)
        self.relay = Relay(tee=tee)
        self.workers: list[_Worker] = []
        self.stopping_since: float | None = None
        for rank, env in zip(ranks, envs):
            # The worker asks for SIGKILL at this (main) thread's death (launch.lifeline).
            proc = subprocess.Popen(
                self.command, env={**env, LAUNCHER_PID_ENV: str(os.getpid())},
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True, bufsize=1, text=True, errors="replace",
            )
            worker = _Worker(rank, proc)
            if log_dir:
                try:
                    os.makedirs(log_dir, exist_ok=True)
                    worker.log = open(os.path.join(log_dir, f"rank{rank}.log"), "a")  # noqa: SIM115
                except OSError:
                    worker.log = None
            pipes = ((cast(IO[str], proc.stdout), sys.stdout),  # both are PIPE: never None
                     (cast(IO[str], proc.stderr), sys.stderr))
            worker.threads = [self.relay.pipe(worker, src, dst) for src, dst in pipes]
            self.workers.append(worker)

    def signal_all(self, signum: int) -> None:
        for w in self.workers:
            if w.proc.poll() is None:
                try:
                    os.killpg(w.proc.pid, signum)
                except ProcessLookupError:
                    pass

    def wait(self, poll: float = 0.05) -> tuple[int, _Worker | None]:
        """Wait until all exit 0, or one fails (then stop the rest); (exit code, failed one)."""
        while True:
            codes = [w.proc.poll() for w in self.workers]
            if self.stopping_since is not None:
                # A forwarded stop: let every worker save and exit within the grace period.
                if all(c is not None for c in codes) or \
                        time.monotonic() - self.stopping_since > STOP_GRACE:
                    self.stop(grace=0.0)
                    nonzero = [w for w in self.workers if w.proc.returncode != 0]
                    return (exit_code(nonzero[0].proc.returncode), nonzero[0]) if nonzero \
                        else (0, None)
                time.sleep(poll)
                continue
            failed = [w for w, c in zip(self.workers, codes) if c not in (None, 0)]
            if failed:
                first = min(failed, key=lambda w: (w.proc.returncode in (-9, -15), w.rank))
                self.stop(grace=5.0)
                return exit_code(first.proc.returncode), first
            if all(c == 0 for c in codes):
                self._join_relays()
                return 0, None
            time.sleep(poll)

    def stop(self, grace: float = STOP_GRACE, signum: int = signal.SIGTERM) -> None:
        self.signal_all(signum)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(w.proc.poll() is None for w in self.workers):
            time.sleep(0.05)
        self.signal_all(signal.SIGKILL)
        for w in self.workers:
            w.proc.wait()
        self._join_relays()

    def _join_relays(self) -> None:
        for w in self.workers:
            for t in w.threads:
                t.join(timeout=2.0)
            if w.log is not None:
                with self.relay.lock:
                    w.log.close()


def node_layout(config: RunConfig) -> tuple[int, int]:
    """(nproc_per_node, nnodes) for a static launch; elastic ranges need the elastic plugin."""
    parts = config.nnodes.split(":")
    if len(parts) == 2 and parts[0] != parts[1]:
        raise UsageError(
            f"--nnodes {config.nnodes} asks for an elastic node range: "
            "pip install distrun-elastic (or give a single number)"
        )
    nnodes = int(parts[0])
    return resolve_nproc(config.nproc_per_node), nnodes


def launch_local(config: RunConfig, command: list[str], environ: dict[str, str]) -> int:
    cluster = per_process_cluster(config, environ)
    if cluster is not None:
        return launch_in_place(config, command, environ, cluster)
    nproc, nnodes = node_layout(config)
    addr, port = config.master_addr, config.master_port
    if nnodes > 1 and port == 0:
        raise UsageError("--master-port is required with --nnodes > 1 (every node must agree)")
    if port == 0:
        port = free_port(addr)
    elif config.node_rank == 0:
        check_port(addr, port)
    world = nproc * nnodes
    run_id = environ.get("TORCHELASTIC_RUN_ID") or uuid.uuid4().hex[:12]
    envs, ranks = [], []
    for local in range(nproc):
        rank = config.node_rank * nproc + local
        env = dict(environ)
        env.update(torchrun_env(rank=rank, local_rank=local, world_size=world,
                                local_world_size=nproc, node_rank=config.node_rank,
                                nnodes=nnodes, master_addr=addr, master_port=port, run_id=run_id))
        if nproc > 1:
            env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("PYTHONUNBUFFERED", "1")
        envs.append(env)
        ranks.append(rank)
    log_dir = os.path.join(config.run_dir, "logs") if config.run_dir else None
    group = WorkerGroup(command, envs, ranks, tee=config.tee, log_dir=log_dir)
    return wait_with_signals(group)


#: layout fields that, set by a flag, variable or file, turn the per-process path off
_LAYOUT_FIELDS = ("nproc_per_node", "nnodes", "node_rank")
_AGENT_VARS = ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT",
               "TORCHELASTIC_MAX_RESTARTS")


def per_process_cluster(config: RunConfig, environ: Mapping[str, str]) -> Any:
    """The detected cluster when its scheduler started one launcher per rank (srun, mpirun).

    None when it did not, or when the user chose the layout (``--nproc-per-node`` etc.).
    """
    from distrun.registry.manager import get_plugin_manager

    cluster = get_plugin_manager().hook.distrun_detect_cluster(environ=dict(environ))
    if cluster is None or not cluster.per_process or None in (cluster.rank, cluster.world_size):
        return None
    if any(not config.sources.get(k, "cluster:").startswith("cluster:") for k in _LAYOUT_FIELDS):
        return None
    return cluster


def launch_in_place(config: RunConfig, command: list[str], environ: dict[str, str],
                    cluster: Any) -> int:
    """Run exactly one worker, rank ``cluster.rank`` of ``cluster.world_size``."""
    nnodes = cluster.nnodes or 1
    if nnodes > 1 and cluster.master_addr is None and "master_addr" not in config.sources:
        raise UsageError(f"{cluster.name} spans {nnodes} nodes but does not say where rank 0 "
                         "runs (export MASTER_ADDR, or pass --master-addr)")
    addr, port = config.master_addr, config.master_port
    if port == 0:
        raise UsageError(f"{cluster.name}: every rank needs the same --master-port (give one)")
    # Under a TorchElastic agent the agent hosts the store and counts the restarts: keep those.
    inherited = {k: environ[k] for k in _AGENT_VARS if k in environ}
    if cluster.rank == 0 and inherited.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        check_port(addr, port)
    local_world = cluster.nproc_per_node or 1
    env = dict(environ)
    env.update(torchrun_env(
        rank=cluster.rank, local_rank=cluster.local_rank or 0, world_size=cluster.world_size,
        local_world_size=local_world, node_rank=cluster.node_rank or 0, nnodes=nnodes,
        master_addr=addr, master_port=port,
        run_id=environ.get("TORCHELASTIC_RUN_ID") or config.name or "distrun"))
    env.update(inherited)
    if local_world > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    log_dir = os.path.join(config.run_dir, "logs") if config.run_dir else None
    group = WorkerGroup(command, [env], [cluster.rank], tee=config.tee, log_dir=log_dir)
    return wait_with_signals(group)


def wait_with_signals(group: WorkerGroup) -> int:
    """Wait for ``group``; SIGINT/SIGTERM to the launcher are forwarded to every worker."""
    received: list[int] = []

    def forward(signum: int, frame: Any) -> None:
        received.append(signum)
        if group.stopping_since is None:
            group.stopping_since = time.monotonic()
        group.signal_all(signal.SIGTERM if signum == signal.SIGINT and len(received) > 1
                         else signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code, failed = group.wait()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    if failed is not None and not received:
        report_failure(failed, code)
    return code
