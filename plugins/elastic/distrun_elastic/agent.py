"""The elastic agent of this node's workers (imports torch): torch's ``LocalElasticAgent``
with distrun's workers and stops; :mod:`distrun_elastic.launch` sets it up and runs it.

torch's agent decides when the workers start, stop and restart (the rendezvous, its restart
budget, the exit barrier); the workers themselves are the core's
:class:`distrun.plugin.WorkerGroup`, as under every distrun launcher (torchrun's environment,
output relayed from pipes with ``--tee``'s prefix, ``--log-dir``'s ``rank<N>.log``, warm
starts: every start of a task's workers, and every restart of a script's, forked from a spare
per local rank that has imported torch, unless ``--no-warm-restart``). Three changes a
subclass of the agent makes:

- when a worker fails, its siblings are told so and get :data:`RESTART_GRACE` seconds (not
  30) to exit before SIGKILL, since they will be restarted from the checkpoint anyway
  (distrun's loop ends its step at once; a stalled rank, asleep inside a step, is killed
  promptly);
- a worker that exits with :data:`distrun.plugin.EXIT_REQUEUE` (it saved a preemption checkpoint)
  or with a usage error (2) ends the run instead of being restarted;
- the first failure's rank and last lines are kept, so it is reported once.

Each attempt's workers get a new store on a fresh port chosen by rendezvous rank 0: on one
node this agent hosts it before the workers start (``TORCHELASTIC_USE_AGENT_STORE=True``, every
worker a client of a store already listening, so none waits out torch's connect backoff); across
nodes, worker rank 0 hosts it.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from distrun.plugin import (
    EXIT_REQUEUE,
    NodeRanks,
    WorkerGroup,
    exit_code,
    listen_socket,
    serve_store,
)
from distrun_elastic.liveness import Liveness, LostPeer, publish_generation
from distrun_elastic.settings import RESTART_GRACE, ElasticPlan

__all__ = ["CutOff", "DistrunAgent", "root_cause"]

#: LocalElasticAgent(shutdown_timeout=...) exists (torch 2.13's does; 2.11's
#: has no such argument: the GPU lane's restart check failed on it)
_TAKES_SHUTDOWN_TIMEOUT = "shutdown_timeout" in inspect.signature(LocalElasticAgent).parameters

_USAGE_ERROR = 2
#: what an agent sets in its round's store before it stops a healthy group to take in waiting
#: nodes: the other nodes' workers stop at the same step boundary (exit 143, the stop vote),
#: and their agents re-form too rather than take it for a requeue. The count of waiting nodes
#: alone raced: the agent that re-formed first had taken them in already (the late-join test,
#: 3 failures in 10 under load once a restart got faster).
_RE_FORMING = "distrun.re-forming"
#: signals the launcher forwards to the workers (SIGUSR1: SLURM's --signal warning)
_FORWARDED = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
#: phrases of a rank that failed because a peer died first (not the root cause)
_SECONDARY = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


#: the signal the heartbeat thread sends the agent's main thread when the store is lost
_WAKE = signal.SIGUSR2
#: seconds the main thread gets to unwind after that signal before the process ends without it
UNWIND_GRACE = 2.0


def _re_forming(worker_group: Any) -> bool:
    """Whether this round's nodes re-form to take in waiting nodes: some wait, or an agent
    said it re-forms (:data:`_RE_FORMING`; by the time a node's workers stopped with its own,
    that agent may have taken the waiting nodes in already)."""
    if _nodes_waiting(worker_group) > 0:
        return True
    try:
        return bool(worker_group.store.check([_RE_FORMING]))
    except Exception:  # noqa: BLE001 - a store that is gone: no re-form to join
        return False


def _nodes_waiting(worker_group: Any) -> int:
    """Nodes waiting at the rendezvous to join the next round (0 if it cannot be asked)."""
    try:
        return int(worker_group.spec.rdzv_handler.num_nodes_waiting())
    except Exception:  # noqa: BLE001 - a store that is gone: no re-form to wait for
        return 0


def _say(message: str) -> None:
    sys.stderr.write(f"distrun: {message}\n")


class CutOff(Exception):
    """This node lost the rendezvous store: it is partitioned, or the store's host is down."""

    def __init__(self, endpoint: str, silent_for: float | None = None) -> None:
        how_long = f" for {silent_for:.0f} s" if silent_for is not None else ""
        super().__init__(
            f"cannot reach the rendezvous store at {endpoint}{how_long} (this host is cut "
            "off from it, or the host running it is down); stopped this node's workers; exit "
            f"{EXIT_REQUEUE}: relaunch this node to rejoin the run")


class DistrunAgent(LocalElasticAgent):
    """torch's local agent, its workers a :class:`distrun.plugin.WorkerGroup` (torchrun's
    environment, warm starts, output relayed from pipes, exits watched), with prompt sibling
    stops, requeue exits and one failure report."""

    def __init__(self, *args: Any, plan: ElasticPlan, host_store: bool = False,
                 bind: str | None = None, trains_task: bool = True,
                 log_dir: str | None = None, error_dir: str | None = None,
                 scratch: str | None = None, services: Sequence[Any] = (),
                 shutdown_timeout: float = 30, **kwargs: Any) -> None:
        # a torch that takes the stop's grace as an argument gets it; an older one's calls of
        # _shutdown pass none, and ours (below) reads this attribute either way
        if _TAKES_SHUTDOWN_TIMEOUT:
            kwargs["shutdown_timeout"] = shutdown_timeout
        super().__init__(*args, **kwargs)
        self._shutdown_timeout = shutdown_timeout
        self.services = list(services)
        #: the rendezvous round of this node's current attempt (DISTRUN_RDZV_GENERATION)
        self.generation: int | None = None
        #: where the workers' log files go (``--log-dir``) and their error files (there, else
        #: in ``scratch``, a temporary folder of this run's, removed at its end)
        self.log_dir, self.error_dir, self.scratch = log_dir, error_dir, scratch
        #: this attempt's workers (None before the first start)
        self.group: WorkerGroup | None = None
        self.plan = plan
        #: the workers run a task of the core's loop (else a plain script or another program,
        #: whose checkpoints, if any, are its own)
        self.trains_task = trains_task
        self.bind = bind
        #: (global rank, return code) of the worker that failed first in the current attempt
        self.root_cause: tuple[int, int] | None = None
        #: the peers whose heartbeat stopped, when that ended the current attempt
        self.lost_peers: list[LostPeer] = []
        self.restarts = 0
        self.host_store = host_store
        #: the store this agent serves the current attempt's workers (torch's own ``_store`` is the
        #: rendezvous store, which its exit barrier uses: not to be confused)
        self._attempt_store: Any = None
        self.liveness: Liveness | None = None
        #: seconds of failed store calls that cut this node off (None: not cut off)
        self.cut_off_after: float | None = None
        #: set by the main thread once the cut-off signal reached it
        self.unwound = threading.Event()
        #: the warm spares the workers are forked from (``WorkerGroup.spares``; None: every
        #: start is cold)
        self.warm: Any = None
        #: what starts the spares once the first workers have started (None: nothing to start)
        self.make_warm: Callable[[], Any] | None = None
        self._ending = threading.Lock()
        self._rounds = 0
        #: a restart is under way: the old workers' stop need not wait for their reap
        self._restarting = False
        #: the groups of the earlier attempts (joined at the end: see WorkerGroup.finish)
        self._earlier: list[WorkerGroup] = []

    def _rendezvous(self, worker_group: Any) -> None:
        self.stop_liveness()
        super()._rendezvous(worker_group)
        store = worker_group.store
        self.generation = publish_generation(store, self.plan.run_id, worker_group.group_rank)
        if self.plan.max_nodes > 1 and worker_group.group_world_size > 1:
            self.liveness = Liveness(store, worker_group.group_rank,
                                     worker_group.group_world_size,
                                     interval=self.plan.heartbeat_interval,
                                     timeout=self.plan.heartbeat_timeout,
                                     on_cut_off=self._cut_off)
        self._rounds += 1
        if self._rounds > 1 and self.plan.max_nodes > 1:
            world = worker_group.workers[0].world_size
            nodes = worker_group.group_world_size
            _say(f"re-formed at {world} rank{'s' * (world != 1)} on {nodes} "
                 f"host{'s' * (nodes != 1)}")

    def claim_end(self) -> bool:
        """True for the first caller only: the one that says how this node ended."""
        return self._ending.acquire(blocking=False)

    def _cut_off(self, silent: float) -> None:
        """From the heartbeat thread: stop the workers, then interrupt the main thread; end the
        process from here if the main thread does not unwind.

        The main thread is often inside one of torch's store calls that never returns once the
        store is unreachable: ``TCPStore.get`` gives up its wait after ``read_timeout`` and then
        reads the answer to its cancel with no timeout (``compare_set`` and ``add`` have none at
        all), and torch's socket code retries a read that a signal interrupts, so the signal's
        handler never runs. The workers are stopped already: nothing is left to do but say it.
        """
        self.cut_off_after = silent
        self._kill_workers()
        signal.pthread_kill(threading.main_thread().ident or 0, _WAKE)
        if self.unwound.wait(UNWIND_GRACE) or not self.claim_end():
            return
        self.remove_scratch()
        _say(str(CutOff(self.plan.rdzv_endpoint, silent)))
        sys.stdout.flush()
        os._exit(EXIT_REQUEUE)

    def remove_scratch(self) -> None:
        """Remove the workers' error files the user did not ask for (their lines were relayed)."""
        if self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None

    def stop_liveness(self) -> None:
        if self.liveness is not None:
            self.liveness.stop()
            self.liveness = None

    def _restart_workers(self, worker_group: Any) -> None:
        if self.root_cause is None:  # a healthy group: re-formed to take in waiting nodes
            with contextlib.suppress(Exception):  # a store that is gone: nobody to tell
                worker_group.store.set(_RE_FORMING, "1")
        self._restarting = True  # the stop in it need not wait for the old workers' reap
        try:
            super()._restart_workers(worker_group)
        finally:
            self._restarting = False

    def _start_workers(self, worker_group: Any) -> dict[int, Any]:
        self.root_cause = None
        self.lost_peers = []
        self._attempt_store = None  # the previous attempt's server closes with its last reference
        if self.host_store and worker_group.group_rank == 0:
            # The agent of the round's node 0 serves each attempt's workers a new store, on its
            # address only (torch's own TCPStore binds every interface) and already listening
            # on the port rendezvous picked, so no worker waits out a connect backoff for rank 0
            # to start one, and no key of an earlier attempt survives (pytorch#167288).
            addr, port = worker_group.master_addr, worker_group.master_port
            self._attempt_store = serve_store(listen_socket(self.bind or addr, port), addr,
                                              shared=False)
        try:
            return self._start_group(worker_group)
        finally:
            if self.warm is None and self.make_warm is not None:
                # the spares of a script start once its first workers have started
                self.warm, self.make_warm = self.make_warm(), None
            elif self.warm is not None:
                self.warm.renew()  # a spare that died is replaced, in the background

    def _start_group(self, worker_group: Any) -> dict[int, int]:
        """Start this round's workers in a worker group: torchrun's variables for the ranks
        the rendezvous gave this node, the agent's store when it hosts one; {local rank: pid}."""
        spec = worker_group.spec
        first = worker_group.workers[0]
        ranks = NodeRanks(
            nproc=spec.local_world_size, node_rank=worker_group.group_rank,
            nnodes=worker_group.group_world_size, world_size=first.world_size,
            first_rank=first.global_rank - first.local_rank,
            master_addr=worker_group.master_addr, master_port=worker_group.master_port,
            run_id=spec.rdzv_handler.get_run_id(),
            restart_count=spec.max_restarts - self._remaining_restarts,
            max_restarts=spec.max_restarts, role=spec.role,
            signals=os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", _FORWARDED),
            config=self.plan.config, run_key=self.plan.run_key, generation=self.generation,
            bind=self.plan.bind_address)
        extra = {"TORCHELASTIC_USE_AGENT_STORE": str(spec.rdzv_handler.use_agent_store)}
        # each attempt's group relays its own output (a restarted group's tracebacks are
        # printed again)
        if self.group is not None:
            self._earlier.append(self.group)  # (its workers may still be being reaped)
        self.group = WorkerGroup([spec.entrypoint, *spec.args], ranks, environ=os.environ,
                                 extra_env=extra, log_dir=self.log_dir,
                                 error_dir=self.error_dir, tee=self.plan.tee,
                                 warm=self.warm, services=self.services).start()
        _stop_with_signals()  # as torch's own process context does: SignalException in run()
        return {w.local_rank: w.proc.pid for w in self.group.workers}

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM,
                  timeout: float | None = None) -> None:
        if self.group is not None:
            grace = self._shutdown_timeout if timeout is None else timeout
            self.group.stop(grace=float(grace), signum=death_sig, reap=not self._restarting)
        if not self._restarting:  # the end: every earlier attempt's workers reaped too
            for group in self._earlier:
                group.finish()
            self._earlier = []

    def _monitor_workers(self, worker_group: Any) -> RunResult:
        if self.liveness is not None:
            lost = self.liveness.lost()
            if lost and self.root_cause is None:
                return self._lose(worker_group, lost)
        # one look at the workers' exits for both: with two, a rank that died between them
        # failed the attempt with no root cause, and it restarted without a word
        codes = self.group.poll() if self.group is not None else []
        self._stop_siblings_of_failure(codes)
        result = self._result(codes)
        failed = result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY)
        if failed and self.root_cause and self.root_cause[1] == EXIT_REQUEUE and \
                _re_forming(worker_group):
            # Not a stop of this run: a node joins, another node's agent stopped its workers
            # to re-form first, and ours stopped with them at the step boundary (the stop vote),
            # saving that step. This node re-forms too, as torch's loop does for a waiting
            # node from a healthy group, and spends no restart.
            self.root_cause = None
            self._restart_workers(worker_group)
            return RunResult(state=WorkerState.HEALTHY)
        if failed and self.root_cause:
            rank, code = self.root_cause
            if code in (EXIT_REQUEUE, _USAGE_ERROR):
                self._remaining_restarts = 0
            elif self._remaining_restarts > 0:
                self.restarts += 1
                why = "the ranks stalled (said above)" if self.group is not None and \
                    self.group.aborted else f"rank {rank} exited with code {exit_code(code)}"
                _say(f"{why}; restarting the workers"
                     f"{self._resumes} (restart {self.restarts} of "
                     f"{worker_group.spec.max_restarts})")
        return result

    @property
    def _resumes(self) -> str:
        """How a restarted attempt goes on: distrun holds the checkpoints of a task only."""
        if self.trains_task:
            return " from the latest checkpoint"
        return ": the script starts over, and resumes from its own checkpoint if it saves one"

    def _lose(self, worker_group: Any, lost: list[LostPeer]) -> RunResult:
        """Stop this node's workers (they wait on the lost peers) and fail the attempt."""
        self.lost_peers = lost
        names = ", ".join(f"{p.hostname} (node {p.group_rank})" for p in lost)
        quiet = max(p.silent_for for p in lost)
        _say(f"lost host {names}: no heartbeat for {quiet:.0f} s; stopping this node's "
             "workers to re-form without it")
        self._kill_workers()
        first = min(w.global_rank for w in worker_group.workers)
        self.root_cause = (first, -int(signal.SIGKILL))
        if self._remaining_restarts > 0:
            self.restarts += 1
            _say(f"re-forming{self._resumes} (restart {self.restarts} of "
                 f"{worker_group.spec.max_restarts})")
        return RunResult(state=WorkerState.FAILED)

    def _result(self, codes: list[int | None]) -> RunResult:
        """The attempt's state from its workers' exits ``codes``, as torch's agent reports
        it."""
        group = self.group
        if group is None:
            return RunResult(state=WorkerState.UNKNOWN)
        failures = {
            w.rank: ProcessFailure(local_rank=w.local_rank, pid=w.proc.pid, exitcode=code,
                                   error_file=group.error_file(w.rank) or "")
            for w, code in zip(group.workers, codes) if code not in (None, 0)}
        if failures:
            return RunResult(state=WorkerState.FAILED, failures=failures)
        if all(code == 0 for code in codes):
            return RunResult(state=WorkerState.SUCCEEDED,
                             return_values={w.rank: None for w in group.workers})
        return RunResult(state=WorkerState.HEALTHY)

    def _kill_workers(self) -> None:
        """SIGKILL this node's workers: they cannot finish a step without their peers."""
        if self.group is not None:
            self.group.stop(grace=0.0, signum=signal.SIGKILL)

    def _stop_siblings_of_failure(self, codes: list[int | None]) -> None:
        """A failure in the workers' exits ``codes``: its root cause, and the others stopped."""
        group = self.group
        if group is None or self.root_cause is not None:
            return
        failed = [(w.local_rank, c) for w, c in zip(group.workers, codes)
                  if c not in (None, 0)]
        if not failed:
            return
        ranks = {w.local_rank: w.rank for w in group.workers}
        tails = {w.local_rank: w for w in group.workers}

        def secondary(lr: int) -> bool:
            # Several ranks may have exited between two polls: prefer one that did not merely
            # lose a peer (its last lines on stderr say so once it has exited).
            return any(p in line for line in tails[lr].err_tail for p in _SECONDARY)

        lr, code = root_cause(failed, ranks, secondary)
        self.root_cause = (ranks.get(lr, lr), code)
        if code == EXIT_REQUEUE:
            # a checkpoint was committed: the others are finishing the same
            group.stop(grace=float(self._shutdown_timeout))
        else:
            # a restart follows: it need not wait for the kernel to free the workers' memory
            restarts = self._remaining_restarts > 0 and code != _USAGE_ERROR
            group.stop_after_failure(*self.root_cause, grace=RESTART_GRACE, reap=not restarts)


def root_cause(failed: list[tuple[int, int]], ranks: dict[int, int],
               secondary: Callable[[int], bool]) -> tuple[int, int]:
    """The failure that stopped the attempt, of ``failed`` ((local rank, exit code) pairs; the
    code ``-N`` for signal N; ``ranks``: local to global rank): a rank killed by a signal
    first, then one that did not merely lose a peer (``secondary``), then the lowest rank.
    (The others are stopped only once it is chosen: none of their exits is the stop's.)
    """
    return min(failed, key=lambda f: (f[1] >= 0, secondary(f[0]), ranks.get(f[0], 0)))


def _stop_with_signals() -> None:
    """The signals the workers' stop follows (``TORCHELASTIC_SIGNALS_TO_HANDLE``) raise torch's
    SignalException in the agent's main thread, as torch's own process context arranges: its
    run() then stops the workers with that signal and
    :func:`distrun_elastic.launch.launch_elastic` says how it ended."""
    if threading.current_thread() is not threading.main_thread():
        return

    def raise_it(signum: int, frame: Any) -> None:
        sig = signal.Signals(signum)
        raise SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)

    for name in os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", _FORWARDED).split(","):
        sig = getattr(signal, name.strip(), None)
        if sig is not None:
            signal.signal(sig, raise_it)
