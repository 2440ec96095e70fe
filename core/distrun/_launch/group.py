"""The ranks of one node: one object that starts them and owns their lives (torch-free).

Every launcher is a policy over a :class:`WorkerGroup`: the local launcher runs one group until
it ends; the elastic agent starts one at each rendezvous round; distrun-ft runs one per replica
group and restarts a lost one; the Ray actor runs a group of one rank on its node; the notebook
launcher takes the ranks' environment from :class:`~distrun._launch.ranks.NodeRanks`. What a
rank needs is built here once:

- the environment (:mod:`distrun._launch.ranks`): exactly torchrun's variables, where the
  ranks' servers listen, the launcher's pid for the worker's lifeline, one OpenMP thread per
  rank where ranks share the node, and the launcher's own variables (``extra``);
- rank 0's rendezvous store: a socket bound here and handed to that rank only;
- the start: forked from a warm spare when the launcher has one, else a new interpreter, each
  in its own session (a signal to the group reaches what the rank started);
- its output: relayed line by line (``--tee`` prefixes), into ``--log-dir`` files
  (:mod:`distrun._launch.outputs`), or left on the launcher's own streams;
- its end: an exit watch that sleeps until a rank exits, signals forwarded, a stop with grace,
  the rank that failed first named with its last line, every process reaped;
- the node's services: objects with ``started(group)`` and ``ended(group)`` (a plugin offers
  them through the ``distrun_node_services`` hook), told of each start and end;
- where each rank is: a folder (:attr:`WorkerGroup.positions`) in which every rank keeps its
  position record and its stack dumps (:mod:`distrun._diagnose`), read by the stall watcher
  and ``distrun stacks``; the launcher's note there, when it stops the ranks because one
  failed, lets them stop at once (:mod:`distrun._launch.failure_note`).
"""

from __future__ import annotations

import collections
import contextlib
import glob
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

from distrun._config.run_config import RunConfig
from distrun._diagnose.position import POSITIONS_ENV
from distrun._launch.exits import ExitWatch, exit_code, exiting_code, has_begun_exit, holds_device
from distrun._launch.failure_note import write_note
from distrun._launch.outputs import WorkerOutputs, worker_outputs
from distrun._launch.ranks import NodeRanks
from distrun._launch.relay import LineSink, PipeReader, Relay, SinkRelay, new_tail
from distrun._launch.warm import WarmPool
from distrun._spec.node import NodeService

__all__ = ["STOP_GRACE", "Worker", "WorkerGroup", "wait_with_signals"]

#: seconds a worker has, after SIGTERM, to save and exit before SIGKILL
STOP_GRACE = 30.0
#: the most seconds a stop that does not reap waits for the workers' output to be relayed (a
#: console that takes no more output holds it up)
RELAY_DRAIN = 1.0
_warned = False  # the oversubscription warning was given (once a process)


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity, as taskset or a container sets)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def warn_oversubscribed(nproc: int) -> None:
    """One warning when this node starts more workers than it has CPU cores (once a process)."""
    global _warned
    if _warned:
        return
    _warned = True
    cores = cpu_cores()
    if nproc > cores:
        sys.stderr.write(
            f"warning: {nproc} worker processes on {cores} CPU core"
            f"{'s' if cores != 1 else ''}: they take turns on the cores, so each step is "
            f"slower than with fewer ranks (--nproc-per-node {cores} fits this machine)\n"
        )


@dataclass
class Worker:
    """One rank's process and what the launcher keeps of it."""

    rank: int
    local_rank: int
    proc: Any  # subprocess.Popen, or a WarmProcess forked by a spare
    tail: collections.deque[str] = field(default_factory=new_tail)
    err_tail: collections.deque[str] = field(default_factory=new_tail)
    threads: list[PipeReader] = field(default_factory=list)
    log: IO[str] | None = None  # LOG_DIR/rank<N>.log, appended by both relays


class WorkerGroup:
    """The ranks of one node: start them, relay their output, watch their exits, stop them.

    :attr:`STOP_GRACE` is the seconds a stopping worker gets to save and exit before SIGKILL.

    ``config``: the run's config, whose output flags then apply (``--tee``, ``--log-dir`` or
    the run folder's ``logs``, ``--redirects``, ``--local-ranks-filter``, torch's error files
    beside the logs). ``log_dir``: each rank's output is also appended to ``rank<N>.log``
    there (torchrun's ``--log-dir``); ``error_dir``: where torch's ``@record`` error files go
    (``rank<N>.error.json``, :meth:`error_file`); None: none. ``relay``: where the workers'
    output goes: None, to the launcher's console line by line (``tee``: prefixed
    ``[rankN]:``); a function ``sink(stream, text)`` (``"out"`` or ``"err"``, each piece as it
    comes) to forward it elsewhere; False, the workers write to the launcher's own streams.
    ``services``: what runs beside the ranks, told of each start and end (a launcher asks the
    run's plugins once, ``config.node_services()``, and gives the same
    services every group it starts). ``store``: rank 0's rendezvous socket, handed to global rank 0
    when it is one of this group's (closed here once it is). ``warm``: spares to fork the
    workers from (:meth:`spares`; a rank whose spare cannot starts cold). ``cwd``: the
    workers' directory. ``name``: what the services' lines call the group where a launcher
    runs several on a node ("replica group 1": ``error: replica group 1: stall at ...``).
    """

    STOP_GRACE = STOP_GRACE

    def __init__(self, command: Sequence[str], ranks: NodeRanks, *,
                 environ: Mapping[str, str] | None = None,
                 extra_env: Mapping[str, str] | Callable[[int], Mapping[str, str]] | None = None,
                 store: socket.socket | None = None, config: RunConfig | None = None,
                 log_dir: str | None = None,
                 error_dir: str | None = None, outputs: WorkerOutputs | None = None,
                 tee: bool = False, relay: Relay | LineSink | bool | None = None,
                 warm: WarmPool | None = None, services: Sequence[NodeService] = (),
                 cwd: str | None = None, name: str = "") -> None:
        self.command = list(command)
        self.name = name
        self.ranks = ranks
        self.environ = dict(os.environ if environ is None else environ)
        self.extra_env = extra_env
        self.store = store
        if outputs is None and config is not None:
            outputs = worker_outputs(config, ranks.base_rank)
        # (``outputs``: the core's launchers pass torchrun's output flags whole)
        self.outputs = outputs or WorkerOutputs(log_dir=log_dir, error_dir=error_dir)
        tee = tee or (config is not None and config.tee)
        self.relay: Relay | None
        if relay is False:
            self.relay = None
        elif isinstance(relay, Relay):
            self.relay = relay
        elif callable(relay):
            self.relay = SinkRelay(relay)
        else:
            self.relay = Relay(tee=tee, show=self.outputs.show)
        self.warm = warm
        self.services = list(services)
        self.cwd = cwd
        self.workers: list[Worker] = []
        #: when a forwarded stop (SIGINT, SIGTERM) began; its grace is counted from here
        self.stopping_since: float | None = None
        self._told_end = False  # the services heard of this start's end
        #: the folder of the ranks' position records and stack dumps, while workers run (made
        #: at each start, removed once they all ended)
        self.positions: str | None = None
        #: why the group ended its workers itself (a stall's summary; None: it did not)
        self.aborted: str | None = None
        #: the threads that reap the workers of stops that did not wait for it (:meth:`finish`)
        self._finishers: list[threading.Thread] = []

    @staticmethod
    def spares(command: Sequence[str], nproc: int, *, environ: Mapping[str, str] | None = None,
               debug: bool = False) -> WarmPool | None:
        """Warm spares for ``command``'s workers (``warm=``), None where it cannot have any.

        One spare per local rank (``nproc``), an interpreter that has imported torch and forks
        each worker of that local rank: a start, or a restart, skips the import. Only
        distrun's own worker (``PYTHON -m distrun._worker.main ...``) can be forked so. Start
        them from the launcher's main thread (they die with the thread that started them).
        The pool's ``renew()`` replaces a spare that died (in the background), ``pids()``
        names them, ``close()`` ends them.
        """
        if not WarmPool.serves(command):
            return None
        return WarmPool(command, nproc, env=os.environ if environ is None else environ,
                        debug=debug)

    # -- start ------------------------------------------------------------------------------
    def env(self, local_rank: int) -> dict[str, str]:
        """The environment local rank ``local_rank`` starts with."""
        rank = self.ranks.rank_of(local_rank)
        extra = self.extra_env(rank) if callable(self.extra_env) else self.extra_env
        env = self.ranks.env(local_rank, self.environ, extra,
                             error_file=self.outputs.error_file(rank),
                             store_fd=self.store.fileno() if self.store is not None else None)
        if self.positions is not None:
            env[POSITIONS_ENV] = self.positions
        for service in self.services:  # what a service hands the ranks (its folder, say)
            provide = getattr(service, "worker_env", None)
            if provide is not None:
                env.update(provide(self))
        return env

    def start(self) -> WorkerGroup:
        """Start every rank of the group; the services are told."""
        self.workers = []
        self.stopping_since = None
        self._told_end = False
        self.aborted = None
        if self.positions is None:  # (removed when the last workers ended)
            self.positions = _positions_folder()
        if not self.ranks.local_ranks:  # (a scheduler that placed each rank chose for itself)
            warn_oversubscribed(self.ranks.workers_here or self.ranks.nproc)
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
        proc = self._fork_warm(self.warm, local, env, piped) \
            if self.warm is not None and not fds else None
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

    def _fork_warm(self, warm: WarmPool, local: int, env: Mapping[str, str], piped: bool) -> Any:
        """(the forked worker, its stdout and stderr pipes), or None: start it cold."""
        if not piped:
            proc = warm.spawn(local, self.command, env, (0, 1, 2), cwd=self.cwd)
            return None if proc is None else (proc, (None, None))
        out, err = os.pipe(), os.pipe()
        try:
            proc = warm.spawn(local, self.command, env, (0, out[1], err[1]), cwd=self.cwd)
        finally:
            os.close(out[1])
            os.close(err[1])
        if proc is None:
            os.close(out[0])
            os.close(err[0])
            return None
        return proc, (open(out[0], "rb", buffering=0), open(err[0], "rb", buffering=0))

    def error_file(self, rank: int) -> str | None:
        """The file torch's ``@record`` writes rank ``rank``'s error to (None: none)."""
        return self.outputs.error_file(rank)

    def _open_log(self, rank: int) -> IO[str] | None:
        if not self.outputs.log_dir:
            return None
        try:
            os.makedirs(self.outputs.log_dir, exist_ok=True)
            return open(os.path.join(self.outputs.log_dir, f"rank{rank}.log"), "a")  # noqa: SIM115
        except OSError:
            return None

    def run(self) -> int:
        """Start the ranks and wait for them, SIGINT and SIGTERM to the launcher forwarded to
        every one; the failed rank named in one line (unless the launcher was asked to stop);
        everything reaped. The exit code: the failed rank's, else 0."""
        try:
            self.start()
            return wait_with_signals(self)
        finally:
            self.close()

    # -- watch ------------------------------------------------------------------------------
    def poll(self) -> list[int | None]:
        """Each worker's exit code (``-N``: ended by signal N), None while it runs; a worker
        that has begun to exit with a failure shows its code at once, before it can be
        reaped (:func:`~distrun._launch.exits.exiting_code`)."""
        return [_code(w.proc) for w in self.workers]

    def alive(self) -> bool:
        """Whether a worker's process is still there (not yet reaped)."""
        return any(w.proc.poll() is None for w in self.workers)

    def failed(self) -> Worker | None:
        """The rank whose failure is the cause, of those that failed so far (None: none).

        Those that failed by themselves (not by a signal) first, then the first to show its
        failure (its first complete traceback, else its streams' end): not a rank that merely
        lost its peer when the cause died.
        """
        codes = {w.rank: _code(w.proc) for w in self.workers}
        failed = [w for w in self.workers if codes[w.rank] not in (None, 0)]
        if not failed:
            return None
        at = self.relay.failed_at if self.relay is not None else (lambda rank: 0.0)
        return min(failed, key=lambda w: (codes[w.rank] in (-9, -15), at(w.rank), w.rank))

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
                    cause = cast(Worker, self.failed())
                    self.stop_after_failure(cause.rank, cast(int, _code(cause.proc)), grace=5.0)
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
    def signal_all(self, signum: int, procs: Sequence[Any] | None = None) -> None:
        """Send ``signum`` to every running worker (of ``procs``: all) and what it started."""
        for w in self.workers:
            if w.proc.poll() is None and (procs is None or w.proc in procs):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(w.proc.pid, signum)

    def stop(self, grace: float = STOP_GRACE, signum: int = signal.SIGTERM, *,
             reap: bool = True) -> None:
        """``signum`` to every worker, SIGKILL to those still running after ``grace`` s; reap.

        ``reap=False`` (a launcher that starts the next workers at once): return as soon as
        every worker has begun to exit, with all they wrote relayed; the rest of their exit
        and the reap go on in the background (:meth:`finish` waits for them). A process is
        reaped only once the kernel has freed its memory, 0.25 s for a rank holding 1.6 GB
        here, and none of it is work a new worker waits for. Where a worker holds a device (a
        GPU, :func:`~distrun._launch.exits.holds_device`) the stop waits for the reap: the
        driver frees the device's memory at the very end of the exit."""
        running = [w.proc for w in self.workers if w.proc.poll() is None]
        ended = _reaped if reap else _exiting
        if running:
            self.signal_all(signum)
            deadline = time.monotonic() + grace
            exits = ExitWatch(running)  # wakes as each one exits, not at the next poll
            try:
                while not all(ended(p) for p in running) and time.monotonic() < deadline:
                    # (the start of an exit shows only in /proc: looked at every 10 ms)
                    exits.wait(min(0.05 if reap else 0.01, max(0.0, deadline - time.monotonic())))
            finally:
                exits.close()
            self.signal_all(signal.SIGKILL, [p for p in running if not ended(p)])
        if not reap and not any(holds_device(p.pid) for p in running if p.poll() is None):
            self._relayed(RELAY_DRAIN)
            first = bool(self.workers) and not self._told_end  # (a second stop finds it told)
            self._tell_services()
            if first:
                thread = threading.Thread(target=self._reap, args=(self._hand_over(),),
                                          name="distrun-reap", daemon=True)
                self._finishers.append(thread)
                thread.start()
            return
        for w in self.workers:
            w.proc.wait()
        self.finish()  # (a stop before that did not reap)
        self._ended()

    def finish(self, timeout: float | None = None) -> None:
        """Wait for the background end of a :meth:`stop` that did not reap (no-op otherwise)."""
        for thread in self._finishers:
            thread.join(timeout)

    def stop_after_failure(self, rank: int, returncode: int, grace: float, *,
                           reap: bool = True) -> None:
        """Stop the ranks that still run because ``rank`` failed (``returncode``: ``-N`` for
        signal N): each is told so first (:mod:`distrun._launch.failure_note`), so distrun's
        loop ends its step at once instead of at the end of a step it cannot finish; SIGKILL
        after ``grace`` seconds. ``reap``: as for :meth:`stop`."""
        if self.positions is not None:
            write_note(self.positions, rank, exit_code(returncode))
        self.stop(grace=grace, reap=reap)

    def abort(self, reason: str) -> None:
        """End every worker now (SIGKILL: a stuck rank saves nothing), for ``reason`` (said
        already): the wait returns as for a failure, and :attr:`aborted` says why.

        Every worker is stopped (SIGSTOP) before any is killed: killed one by one, a rank
        killed last could see a peer's death first and print its traceback after the line
        that said why (the launcher's thread can lose the GIL between two kills)."""
        self.aborted = reason
        self.signal_all(signal.SIGSTOP)
        self.signal_all(signal.SIGKILL)

    def report(self, code: int, failed: Worker, where: str = "") -> None:
        """One line naming the failed rank, its exit code and its last line (see
        :func:`~distrun._launch.relay.report_failure`)."""
        relay = self.relay if self.relay is not None else Relay()
        relay.report(failed, code, where=where, same=relay.same_failure(failed.rank))

    def close(self) -> None:
        """Kill what still runs, reap it, and remove the group's temporary files."""
        self.stop(grace=0.0, signum=signal.SIGKILL)
        self.outputs.cleanup()
        if self.positions is not None:
            shutil.rmtree(self.positions, ignore_errors=True)
            self.positions = None
        if self.store is not None:
            self.store.close()
            self.store = None

    def _ended(self) -> None:
        """Join the relays once the workers have ended; tell the services (once a start)."""
        self._close_outputs(self.workers)
        self._tell_services()
        _remove_records(self._hand_over()[1])

    def _tell_services(self) -> None:
        if self.workers and not self._told_end:
            self._told_end = True
            for service in self.services:
                service.ended(self)

    def _hand_over(self) -> tuple[list[Worker], str | None]:
        """This start's workers and records folder, for their end (the group may start anew)."""
        positions, self.positions = self.positions, None
        return list(self.workers), positions

    def _close_outputs(self, workers: Sequence[Worker]) -> None:
        for w in workers:
            for t in w.threads:
                t.join(timeout=2.0)
            w.threads = []
            if self.relay is not None:
                with self.relay.lock:
                    log, w.log = w.log, None
                    if log is not None:
                        with contextlib.suppress(OSError):  # a full disk: said
                            log.close()

    def _reap(self, ended: tuple[list[Worker], str | None]) -> None:
        workers, positions = ended
        for w in workers:
            w.proc.wait()
        self._close_outputs(workers)
        _remove_records(positions)

    def _relayed(self, timeout: float) -> None:
        """Wait (up to ``timeout`` s) until all the workers wrote is relayed."""
        deadline = time.monotonic() + timeout
        for w in self.workers:
            for t in w.threads:
                t.drained(deadline - time.monotonic())


def _remove_records(positions: str | None) -> None:
    """Remove the ranks' records (nobody reads those of ended workers)."""
    if positions is not None:
        shutil.rmtree(positions, ignore_errors=True)


def _reaped(proc: Any) -> bool:
    return proc.poll() is not None


def _exiting(proc: Any) -> bool:
    return proc.poll() is not None or has_begun_exit(proc.pid)


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
    if group.aborted is not None:
        return 1  # the stall watcher named the cause already: the exit of a timed-out run
    if failed is not None and not received:
        group.report(code, failed)
    return code


def _code(proc: Any) -> int | None:
    """``proc``'s return code, or the code it is exiting with (a failure: see
    :func:`~distrun._launch.exits.exiting_code`), or None while it runs."""
    code = proc.poll()
    return code if code is not None else exiting_code(proc.pid)


_POSITIONS_PREFIX = "distrun-positions-"


def _positions_folder() -> str:
    """A new folder for a group's position records, ``distrun-positions-<launcher pid>-*``
    in the temporary folder. Those of launchers that are gone (kill -9) are removed first."""
    base = tempfile.gettempdir()
    for path in glob.glob(os.path.join(base, _POSITIONS_PREFIX + "*")):
        pid = os.path.basename(path)[len(_POSITIONS_PREFIX):].split("-")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(path, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{_POSITIONS_PREFIX}{os.getpid()}-")
