"""The ranks of one node: one object that starts them and owns their lives (torch-free).

Every launcher is a policy over a :class:`WorkerGroup`: the local launcher runs one group until
it ends; distrun-ft runs one per replica group and restarts a lost one; the Ray actor runs a
group of one rank on its node; the notebook launcher takes the ranks' environment from
:class:`NodeRanks`. What a rank needs is built here once:

- the environment: exactly torchrun's variables (:func:`torchrun_env`), where the ranks'
  servers listen (:func:`~distrun._launch.binding.server_env`), the launcher's pid for the
  worker's lifeline, one OpenMP thread per rank where ranks share the node, and the launcher's
  own variables (``extra``);
- rank 0's rendezvous store: a socket bound here and handed to that rank only;
- the start: forked from a warm spare when the launcher has one, else a new interpreter, each
  in its own session (a signal to the group reaches what the rank started);
- its output: relayed line by line (``--tee`` prefixes), into ``--log-dir`` files, or left on
  the launcher's own streams;
- its end: an exit watch that sleeps until a rank exits, signals forwarded, a stop with grace,
  the rank that failed first named with its last line, every process reaped;
- the node's services: objects with ``started(group)`` and ``ended(group)`` (a plugin offers
  them through the ``distrun_node_services`` hook), told of each start and end.
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, cast

from distrun._config.run_config import DEFAULT_SIGNALS, RunConfig
from distrun._launch.binding import STORE_FD_ENV, server_env
from distrun._launch.exits import ExitWatch, exit_code
from distrun._launch.lifeline import LAUNCHER_PID_ENV
from distrun._launch.relay import Relay, new_tail, report_failure
from distrun._launch.warm import WarmPool
from distrun._spec.node import NodeService

__all__ = ["NodeRanks", "NodeService", "STOP_GRACE", "Worker", "WorkerGroup", "WorkerOutputs",
           "node_services", "torchrun_env", "wait_with_signals", "worker_outputs"]

#: seconds a worker has, after SIGTERM, to save and exit before SIGKILL
STOP_GRACE = 30.0


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


@dataclass(frozen=True)
class NodeRanks:
    """Where this node's ranks sit in the run: what torchrun's variables tell each of them.

    ``local_ranks`` are the local ranks this group starts (all of ``nproc`` by default; a
    scheduler that starts one launcher per rank gives one). ``workers_here`` is how many
    worker processes share this node's cores (several replica groups, say): above one, each
    rank gets one OpenMP thread unless the user set ``OMP_NUM_THREADS``.
    """

    nproc: int
    master_addr: str
    master_port: int
    run_id: str
    node_rank: int = 0
    nnodes: int = 1
    world_size: int = 0  # 0: nproc * nnodes
    first_rank: int = -1  # -1: node_rank * nproc
    local_ranks: tuple[int, ...] = ()
    restart_count: int = 0
    max_restarts: int = 0
    role: str = "default"
    signals: str = DEFAULT_SIGNALS
    #: the address the ranks' servers listen on (gloo, tensorpipe, the store); None: torch's
    bind: str | None = None
    workers_here: int = 0  # 0: nproc

    @property
    def world(self) -> int:
        return self.world_size or self.nproc * self.nnodes

    @property
    def base_rank(self) -> int:
        return self.node_rank * self.nproc if self.first_rank < 0 else self.first_rank

    @property
    def locals(self) -> tuple[int, ...]:
        return self.local_ranks or tuple(range(self.nproc))

    def rank_of(self, local_rank: int) -> int:
        return self.base_rank + local_rank

    def env(self, local_rank: int, environ: Mapping[str, str],
            extra: Mapping[str, str] | None = None,
            error_file: str | None = None) -> dict[str, str]:
        """The whole environment of local rank ``local_rank``: ``environ``, torchrun's
        variables, the servers' address, the launcher's pid, then ``extra``."""
        env = dict(environ)
        env.update(torchrun_env(
            rank=self.rank_of(local_rank), local_rank=local_rank, world_size=self.world,
            local_world_size=self.nproc, node_rank=self.node_rank, nnodes=self.nnodes,
            master_addr=self.master_addr, master_port=self.master_port, run_id=self.run_id,
            restart_count=self.restart_count, max_restarts=self.max_restarts, role=self.role,
            signals=self.signals, error_file=error_file, environ=environ))
        env.update(server_env(self.bind, environ))
        env[LAUNCHER_PID_ENV] = str(os.getpid())
        if (self.workers_here or self.nproc) > 1:
            env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.update(extra or {})
        return env


def _streams(value: str, local_rank: int) -> int:
    """torchrun's ``--redirects`` value for one local rank: 0 none, 1 out, 2 err, 3 both."""
    if ":" not in value:
        return int(value)
    table = dict(item.split(":") for item in value.split(","))
    return int(table.get(str(local_rank), "0"))


@dataclass
class WorkerOutputs:
    """Where a group's output goes: the log folder, torch's error files, the console filter."""

    log_dir: str | None = None
    error_dir: str | None = None  # None: no error files
    temporary: str | None = None  # a folder of ours to remove at the end
    show: Callable[[int, IO[str]], bool] | None = None

    def error_file(self, rank: int) -> str | None:
        return os.path.join(self.error_dir, f"rank{rank}.error.json") if self.error_dir else None

    def cleanup(self) -> None:
        if self.temporary:
            shutil.rmtree(self.temporary, ignore_errors=True)
            self.temporary = None


def worker_outputs(config: RunConfig, first_rank: int) -> WorkerOutputs:
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

    return WorkerOutputs(log_dir, error_dir, temporary, show if shown or redirected else None)


def node_services(config: RunConfig) -> list[NodeService]:
    """The services plugins offer to run beside this node's ranks (``distrun_node_services``)."""
    pm = getattr(config, "pluginmanager", None)
    if pm is None:
        return []
    return [s for s in pm.hook.distrun_node_services(config=config) if s is not None]


@dataclass
class Worker:
    """One rank's process and what the launcher keeps of it."""

    rank: int
    local_rank: int
    proc: Any  # subprocess.Popen, or a WarmProcess forked by a spare
    tail: collections.deque[str] = field(default_factory=new_tail)
    err_tail: collections.deque[str] = field(default_factory=new_tail)
    threads: list[threading.Thread] = field(default_factory=list)
    log: IO[str] | None = None  # LOG_DIR/rank<N>.log, appended by both relays


class WorkerGroup:
    """The ranks of one node: start them, relay their output, watch their exits, stop them.

    ``relay``: a :class:`Relay` (one is made when None) or False to leave the workers on the
    launcher's own streams. ``store``: rank 0's rendezvous socket, handed to global rank 0
    when it is one of this group's (closed here once it is). ``warm``: spares to fork the
    workers from (a rank whose spare cannot starts cold). ``cwd``: the workers' directory.
    """

    def __init__(self, command: Sequence[str], ranks: NodeRanks, *,
                 environ: Mapping[str, str] | None = None,
                 extra_env: Mapping[str, str] | Callable[[int], Mapping[str, str]] | None = None,
                 store: socket.socket | None = None, outputs: WorkerOutputs | None = None,
                 tee: bool = False, relay: Relay | bool | None = None,
                 warm: WarmPool | None = None, services: Sequence[NodeService] = (),
                 cwd: str | None = None) -> None:
        self.command = list(command)
        self.ranks = ranks
        self.environ = dict(os.environ if environ is None else environ)
        self.extra_env = extra_env
        self.store = store
        self.outputs = outputs or WorkerOutputs()
        self.relay: Relay | None = None if relay is False else (
            relay if isinstance(relay, Relay) else Relay(tee=tee, show=self.outputs.show))
        self.warm = warm
        self.services = list(services)
        self.cwd = cwd
        self.workers: list[Worker] = []
        #: when a forwarded stop (SIGINT, SIGTERM) began; its grace is counted from here
        self.stopping_since: float | None = None
        self._told_end = False  # the services heard of this start's end

    # -- start ------------------------------------------------------------------------------
    def env(self, local_rank: int) -> dict[str, str]:
        """The environment local rank ``local_rank`` starts with."""
        rank = self.ranks.rank_of(local_rank)
        extra = self.extra_env(rank) if callable(self.extra_env) else self.extra_env
        env = self.ranks.env(local_rank, self.environ, extra,
                             error_file=self.outputs.error_file(rank))
        if self.store is not None and rank == 0:
            env[STORE_FD_ENV] = str(self.store.fileno())
        return env

    def start(self) -> WorkerGroup:
        """Start every rank of the group; the services are told."""
        self.workers = []
        self.stopping_since = None
        self._told_end = False
        try:
            for local in self.ranks.locals:
                self.workers.append(self._start_one(local))
        finally:
            if self.store is not None:
                self.store.close()  # rank 0 holds it now
                self.store = None
        for service in self.services:
            service.started(self)
        return self

    def _start_one(self, local: int) -> Worker:
        rank = self.ranks.rank_of(local)
        env = self.env(local)
        fds = (self.store.fileno(),) if self.store is not None and rank == 0 else ()
        piped = self.relay is not None
        proc = self._fork_warm(local, env, piped) if self.warm is not None and not fds else None
        if proc is None:
            proc = subprocess.Popen(
                self.command, env=env, cwd=self.cwd, start_new_session=True, pass_fds=fds,
                stdout=subprocess.PIPE if piped else None,
                stderr=subprocess.PIPE if piped else None, bufsize=0)
            pipes = (proc.stdout, proc.stderr)
        else:
            proc, pipes = proc
        worker = Worker(rank, local, proc)
        if self.relay is not None:
            worker.log = self._open_log(rank)
            worker.threads = [self.relay.pipe(worker, cast(IO[bytes], src), dst)
                              for src, dst in zip(pipes, (sys.stdout, sys.stderr))]
        return worker

    def _fork_warm(self, local: int, env: Mapping[str, str], piped: bool) -> Any:
        """(the forked worker, its stdout and stderr pipes), or None: start it cold."""
        assert self.warm is not None
        if not piped:
            proc = self.warm.spawn(local, self.command, env, (0, 1, 2), cwd=self.cwd)
            return None if proc is None else (proc, (None, None))
        out, err = os.pipe(), os.pipe()
        try:
            proc = self.warm.spawn(local, self.command, env, (0, out[1], err[1]), cwd=self.cwd)
        finally:
            os.close(out[1])
            os.close(err[1])
        if proc is None:
            os.close(out[0])
            os.close(err[0])
            return None
        return proc, (open(out[0], "rb", buffering=0), open(err[0], "rb", buffering=0))

    def _open_log(self, rank: int) -> IO[str] | None:
        if not self.outputs.log_dir:
            return None
        try:
            os.makedirs(self.outputs.log_dir, exist_ok=True)
            return open(os.path.join(self.outputs.log_dir, f"rank{rank}.log"), "a")  # noqa: SIM115
        except OSError:
            return None

    # -- watch ------------------------------------------------------------------------------
    def poll(self) -> list[int | None]:
        """Each worker's exit code (``-N``: ended by signal N), None while it runs."""
        return [w.proc.poll() for w in self.workers]

    def alive(self) -> bool:
        return any(c is None for c in self.poll())

    def failed(self) -> Worker | None:
        """The rank whose failure is the cause, of those that failed so far (None: none).

        Those that failed by themselves (not by a signal) first, then the first to show its
        failure (its first complete traceback, else its streams' end): not a rank that merely
        lost its peer when the cause died.
        """
        failed = [w for w in self.workers if w.proc.poll() not in (None, 0)]
        if not failed:
            return None
        at = self.relay.failed_at if self.relay is not None else (lambda rank: 0.0)
        return min(failed, key=lambda w: (w.proc.returncode in (-9, -15), at(w.rank), w.rank))

    def exit_watch(self) -> ExitWatch:
        """A watch that sleeps until one of the running workers exits."""
        return ExitWatch([w.proc for w in self.workers if w.proc.poll() is None])

    def wait(self, poll: float = 0.05) -> tuple[int, Worker | None]:
        """Wait until all exit 0, or one fails (then stop the rest); (exit code, failed one).

        The launcher sleeps until a worker exits (``poll`` seconds between checks only where
        the kernel cannot say so): on a machine whose every core runs a worker, each wake-up of
        the launcher is time taken from one.
        """
        exits = ExitWatch([w.proc for w in self.workers])
        try:
            while True:
                codes = self.poll()
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
                if any(c not in (None, 0) for c in codes):
                    # its relays joined by the stop: when each rank failed is known, and the
                    # cause may still have been in its exit handlers at the poll
                    self.stop(grace=5.0)
                    first = cast(Worker, self.failed())
                    return exit_code(first.proc.returncode), first
                if all(c == 0 for c in codes):
                    self._ended()
                    return 0, None
                # a signal handler that starts a stop runs during this wait; the stop's grace
                # is counted from the next check, at most a second later
                exits.wait(1.0 if exits.blocking else poll)
        finally:
            exits.close()

    # -- stop -------------------------------------------------------------------------------
    def signal_all(self, signum: int) -> None:
        """Send ``signum`` to every running worker and what it started."""
        for w in self.workers:
            if w.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(w.proc.pid, signum)

    def stop(self, grace: float = STOP_GRACE, signum: int = signal.SIGTERM) -> None:
        """``signum`` to every worker, SIGKILL to those still running after ``grace`` s; reap."""
        running = [w.proc for w in self.workers if w.proc.poll() is None]
        if running:
            self.signal_all(signum)
            deadline = time.monotonic() + grace
            exits = ExitWatch(running)  # wakes as each one exits, not at the next poll
            try:
                while any(p.poll() is None for p in running) and time.monotonic() < deadline:
                    exits.wait(min(0.05, max(0.0, deadline - time.monotonic())))
            finally:
                exits.close()
            self.signal_all(signal.SIGKILL)
        for w in self.workers:
            w.proc.wait()
        self._ended()

    def report(self, code: int, failed: Worker, where: str = "") -> None:
        """One line naming the failed rank, its exit code and its last line (see
        :func:`~distrun._launch.relay.report_failure`)."""
        same = self.relay.same_failure(failed.rank) if self.relay is not None else []
        report_failure(failed, code, where=where, same=same)

    def close(self) -> None:
        """Kill what still runs, reap it, and remove the group's temporary files."""
        self.stop(grace=0.0, signum=signal.SIGKILL)
        self.outputs.cleanup()
        if self.store is not None:
            self.store.close()
            self.store = None

    def _ended(self) -> None:
        """Join the relays once the workers have ended; tell the services (once a start)."""
        for w in self.workers:
            for t in w.threads:
                t.join(timeout=2.0)
            w.threads = []
            if w.log is not None and self.relay is not None:
                with self.relay.lock, contextlib.suppress(OSError):  # a full disk: said
                    w.log.close()
                w.log = None
        if self.workers and not self._told_end:
            self._told_end = True
            for service in self.services:
                service.ended(self)


def wait_with_signals(group: WorkerGroup) -> int:
    """Wait for ``group``; SIGINT/SIGTERM to the launcher are forwarded to every worker.

    The failing rank is named in one line unless the launcher was asked to stop.
    """
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
        group.report(code, failed)
    return code
