"""The core's local launcher: start this node's workers with torchrun's environment.

Workers get exactly the variables torchrun sets, so a torchrun script runs unchanged. Their
output is relayed line by line (``--tee`` prefixes the rank); Ctrl-C and SIGTERM are forwarded
to every worker; when one fails the others are stopped and its last lines are shown.
Multi-node static runs rendezvous through torch's env:// TCPStore on ``MASTER_ADDR``.
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, cast

from distrun._config.run_config import DEFAULT_SIGNALS, NPROC_WORDS, RunConfig
from distrun._launch.binding import STORE_FD_ENV, bind_address, listen_socket, server_env
from distrun._launch.exits import ExitWatch, exit_code
from distrun._launch.lifeline import LAUNCHER_PID_ENV
from distrun._launch.ports import check_port, free_port
from distrun._launch.relay import Relay, new_tail, report_failure
from distrun._spec.errors import UsageError

__all__ = ["WorkerGroup", "cpu_cores", "launch_local", "torchrun_env", "warn_oversubscribed"]

#: seconds a worker has, after SIGTERM, to save and exit before SIGKILL
STOP_GRACE = 30.0


def resolve_nproc(value: Any) -> int:
    """torchrun's ``--nproc-per-node``: N, ``cpu``, ``gpu`` (an error without one) or ``auto``."""
    if value not in NPROC_WORDS:
        return int(value)
    if value != "cpu":
        try:
            import torch

            if torch.cuda.is_available():
                return torch.cuda.device_count()
        except ImportError:  # pragma: no cover
            pass
        if value == "gpu":
            raise UsageError("--nproc-per-node gpu: no CUDA device is visible (use a number, "
                             "cpu or auto)")
    return os.cpu_count() or 1


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity, as taskset or a container sets)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def warn_oversubscribed(nproc: int) -> None:
    """One warning when this node starts more workers than it has CPU cores."""
    cores = cpu_cores()
    if nproc > cores:
        sys.stderr.write(
            f"warning: {nproc} worker processes on {cores} CPU core"
            f"{'s' if cores != 1 else ''}: they take turns on the cores, so each step is "
            f"slower than with fewer ranks (--nproc-per-node {cores} fits this machine)\n"
        )


def torchrun_env(*, rank: int, local_rank: int, world_size: int, local_world_size: int,
                 node_rank: int, nnodes: int, master_addr: str, master_port: int,
                 run_id: str, restart_count: int = 0, max_restarts: int = 0,
                 role: str = "default", signals: str = DEFAULT_SIGNALS,
                 error_file: str | None = None,
                 environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables torchrun gives a worker (see torch.distributed.run and its agent).

    ``TORCHELASTIC_USE_AGENT_STORE`` is False: rank 0 hosts the store (env://), no agent does.
    ``error_file`` is where torch's ``@record`` writes a failing worker's error.
    """
    environ = os.environ if environ is None else environ
    env: dict[str, Any] = {
        "RANK": rank, "LOCAL_RANK": local_rank, "WORLD_SIZE": world_size,
        "LOCAL_WORLD_SIZE": local_world_size, "GROUP_RANK": node_rank,
        "GROUP_WORLD_SIZE": nnodes, "ROLE_RANK": rank, "ROLE_WORLD_SIZE": world_size,
        "ROLE_NAME": role, "MASTER_ADDR": master_addr, "MASTER_PORT": master_port,
        "TORCHELASTIC_RESTART_COUNT": restart_count, "TORCHELASTIC_MAX_RESTARTS": max_restarts,
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "TORCHELASTIC_SIGNALS_TO_HANDLE": signals,
    }
    if error_file:
        env["TORCHELASTIC_ERROR_FILE"] = error_file
    return {k: str(v) for k, v in env.items()}


def _streams(value: str, local_rank: int) -> int:
    """torchrun's ``--redirects`` value for one local rank: 0 none, 1 out, 2 err, 3 both."""
    if ":" not in value:
        return int(value)
    table = dict(item.split(":") for item in value.split(","))
    return int(table.get(str(local_rank), "0"))


@dataclass
class _Outputs:
    """Where a launch's worker output goes: log folder, error files, the console filter."""

    log_dir: str | None
    error_dir: str
    temporary: str | None  # a folder of ours to remove at the end
    show: Any

    def error_file(self, rank: int) -> str:
        return os.path.join(self.error_dir, f"rank{rank}.error.json")

    def cleanup(self) -> None:
        if self.temporary:
            shutil.rmtree(self.temporary, ignore_errors=True)


def _outputs(config: RunConfig, first_rank: int) -> _Outputs:
    """torchrun's --log-dir, --redirects and --local-ranks-filter for this node's workers.

    Logs go to ``--log-dir`` or ``RUN_DIR/logs`` when there is a run folder, else nowhere;
    torch's error files go beside them, or into a temporary folder removed at the end (as
    torchrun's own). Redirected output needs files: without a log folder it goes to a kept
    temporary one, said once.
    """
    log_dir = config.log_dir or (os.path.join(config.run_dir, "logs") if config.run_dir else None)
    temporary = None
    redirected = config.redirects not in ("0", "")
    if redirected and not log_dir:
        log_dir = tempfile.mkdtemp(prefix="distrun-logs-")
        sys.stderr.write(
            f"distrun: --redirects {config.redirects}: worker output goes to {log_dir}\n"
        )
    if log_dir:
        error_dir = os.path.abspath(log_dir)  # a worker may change its directory
    else:
        error_dir = temporary = tempfile.mkdtemp(prefix="distrun-errors-")
    shown = {int(r) for r in config.local_ranks_filter.split(",") if r}

    def show(rank: int, dst: IO[str]) -> bool:
        local = rank - first_rank
        if shown and local not in shown:
            return False
        if redirected:
            mask = _streams(config.redirects, local)
            return not mask & (2 if dst is sys.stderr else 1)
        return True

    return _Outputs(log_dir, error_dir, temporary,
                    show if shown or redirected else None)


@dataclass
class _Worker:
    rank: int
    proc: subprocess.Popen
    tail: collections.deque[str] = field(default_factory=new_tail)
    err_tail: collections.deque[str] = field(default_factory=new_tail)
    threads: list[threading.Thread] = field(default_factory=list)
    log: IO[str] | None = None  # run_dir/logs/rank<N>.log, appended by both relays


class WorkerGroup:
    """This node's worker processes: start, relay output, forward signals, wait, stop."""

    def __init__(self, command: Sequence[str], envs: Sequence[Mapping[str, str]],
                 ranks: Sequence[int], tee: bool = False, log_dir: str | None = None,
                 relay: Relay | None = None,
                 pass_fds: Mapping[int, Sequence[int]] | None = None) -> None:
        """``pass_fds``: by rank, descriptors that worker inherits (the store's socket)."""
        self.command = list(command)
        self.relay = relay or Relay(tee=tee)
        self.workers: list[_Worker] = []
        self.stopping_since: float | None = None
        for rank, env in zip(ranks, envs):
            # The worker asks for SIGKILL at this (main) thread's death (launch.lifeline).
            proc = subprocess.Popen(
                self.command, env={**env, LAUNCHER_PID_ENV: str(os.getpid())},
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,  # bytes, relayed as they come
                start_new_session=True, bufsize=0,
                pass_fds=tuple((pass_fds or {}).get(rank, ())),
            )
            worker = _Worker(rank, proc)
            if log_dir:
                try:
                    os.makedirs(log_dir, exist_ok=True)
                    worker.log = open(os.path.join(log_dir, f"rank{rank}.log"), "a")  # noqa: SIM115
                except OSError:
                    worker.log = None
            pipes = ((cast(IO[bytes], proc.stdout), sys.stdout),  # both are PIPE: never None
                     (cast(IO[bytes], proc.stderr), sys.stderr))
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
        """Wait until all exit 0, or one fails (then stop the rest); (exit code, failed one).

        The launcher sleeps until a worker exits (``poll`` seconds between checks only where
        the kernel cannot say so): on a machine whose every core runs a worker, each wake-up of
        the launcher is time taken from one.
        """
        exits = ExitWatch([w.proc for w in self.workers])
        try:
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
                    exits.wait(poll)
                    continue
                failed = [w for w, c in zip(self.workers, codes) if c not in (None, 0)]
                if failed:
                    self.stop(grace=5.0)  # its relays joined: when each rank failed is known
                    # The cause, not a rank that lost its peer when it died: of every rank that
                    # failed (the cause may still have been in its exit handlers at the poll,
                    # and ends during the stop), those that failed by themselves (not by a
                    # signal) first, and of those the first to show its failure.
                    failed = [w for w in self.workers if w.proc.returncode != 0]
                    first = min(failed, key=lambda w: (w.proc.returncode in (-9, -15),
                                                       self.relay.failed_at(w.rank), w.rank))
                    return exit_code(first.proc.returncode), first
                if all(c == 0 for c in codes):
                    self._join_relays()
                    return 0, None
                # a signal handler that starts a stop runs during this wait; the stop's grace
                # is counted from the next check, at most a second later
                exits.wait(1.0 if exits.blocking else poll)
        finally:
            exits.close()

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
                with self.relay.lock, contextlib.suppress(OSError):  # a full disk: said
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


def launch_local(config: RunConfig, command: list[str], environ: dict[str, str],
                 cluster: Any = None) -> int:
    """Start this node's workers (or, under srun/mpirun, be the one rank ``cluster`` names)."""
    in_place = per_process_cluster(config, cluster)
    if in_place is not None:
        return launch_in_place(config, command, environ, in_place)
    nproc, nnodes = node_layout(config)
    warn_oversubscribed(nproc)
    addr, port = config.master_addr, config.master_port
    if nnodes > 1 and port == 0:
        raise UsageError("--master-port is required with --nnodes > 1 (every node must agree)")
    bind = bind_address(nnodes, addr, config.local_addr)
    store = _store_socket(config, bind, port) if config.node_rank == 0 else None
    if store is not None:
        port = store.getsockname()[1]
    elif port == 0:
        port = free_port(addr)
    elif config.node_rank == 0:
        check_port(addr, port)
    world = nproc * nnodes
    run_id = environ.get("TORCHELASTIC_RUN_ID") or uuid.uuid4().hex[:12]
    outputs = _outputs(config, config.node_rank * nproc)
    envs, ranks = [], []
    for local in range(nproc):
        rank = config.node_rank * nproc + local
        env = dict(environ)
        env.update(torchrun_env(rank=rank, local_rank=local, world_size=world,
                                local_world_size=nproc, node_rank=config.node_rank,
                                nnodes=nnodes, master_addr=addr, master_port=port, run_id=run_id,
                                role=config.role, signals=config.signals_to_handle,
                                error_file=outputs.error_file(rank), environ=environ))
        env.update(server_env(bind, environ))
        if store is not None and rank == 0:
            env[STORE_FD_ENV] = str(store.fileno())
        if nproc > 1:
            env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("PYTHONUNBUFFERED", "1")
        envs.append(env)
        ranks.append(rank)
    try:
        fds = {0: [store.fileno()]} if store is not None else None
        try:
            group = WorkerGroup(command, envs, ranks, tee=config.tee, log_dir=outputs.log_dir,
                                relay=Relay(tee=config.tee, show=outputs.show), pass_fds=fds)
        finally:
            if store is not None:
                store.close()  # rank 0 holds it now
        return wait_with_signals(group)
    finally:
        outputs.cleanup()


def _store_socket(config: RunConfig, bind: str | None, port: int) -> socket.socket | None:
    """The rendezvous store's socket, bound on the run's address, for rank 0 to serve on.

    None where torch binds its own: no bind address decided (several nodes) or an executable
    (``--no-python``) that cannot take the socket over.
    """
    if bind is None or config.no_python:
        return None
    return listen_socket(bind, port)


#: layout fields that, set by a flag, variable or file, turn the per-process path off
_LAYOUT_FIELDS = ("nproc_per_node", "nnodes", "node_rank")
_AGENT_VARS = ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT",
               "TORCHELASTIC_MAX_RESTARTS")


def per_process_cluster(config: RunConfig, cluster: Any) -> Any:
    """``cluster`` (the detected one) when its scheduler started one launcher per rank (srun,
    mpirun). None when it did not, or when the user chose the layout (``--nproc-per-node``
    etc.).
    """
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
    outputs = _outputs(config, cluster.rank - (cluster.local_rank or 0))
    env = dict(environ)
    env.update(torchrun_env(
        rank=cluster.rank, local_rank=cluster.local_rank or 0, world_size=cluster.world_size,
        local_world_size=local_world, node_rank=cluster.node_rank or 0, nnodes=nnodes,
        master_addr=addr, master_port=port,
        run_id=environ.get("TORCHELASTIC_RUN_ID") or config.name or "distrun",
        role=config.role, signals=config.signals_to_handle,
        error_file=environ.get("TORCHELASTIC_ERROR_FILE") or outputs.error_file(cluster.rank),
        environ=environ))
    env.update(inherited)
    if local_world > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    try:
        group = WorkerGroup(command, [env], [cluster.rank], tee=config.tee,
                            log_dir=outputs.log_dir,
                            relay=Relay(tee=config.tee, show=outputs.show))
        return wait_with_signals(group)
    finally:
        outputs.cleanup()


def wait_with_signals(group: WorkerGroup) -> int:
    """Wait for ``group``; SIGINT/SIGTERM to the launcher are forwarded to every worker."""
    received: list[int] = []

    def forward(signum: int, frame: Any) -> None:
        received.append(signum)
        if group.stopping_since is None:
            group.stopping_since = time.monotonic()
        # a second Ctrl-C goes on as SIGINT too: a worker that is already stopping at the next
        # step boundary takes it as "now" (KeyboardInterrupt)
        group.signal_all(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code, failed = group.wait()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    if failed is not None and not received:
        report_failure(failed, code, same=group.relay.same_failure(failed.rank))
    return code
