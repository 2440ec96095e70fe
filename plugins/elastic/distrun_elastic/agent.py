"""Run this node's workers under torch.distributed.elastic's agent (imports torch).

This mirrors ``torch.distributed.launcher.api.launch_agent`` (rendezvous handler, worker spec,
``LocalElasticAgent``): torch's agent decides when the workers start, stop and restart (the
rendezvous, its restart budget, the exit barrier); the workers themselves are the core's
:class:`distrun.plugin.WorkerGroup`, as under every distrun launcher (torchrun's environment,
output relayed from pipes with ``--tee``'s prefix, ``--log-dir``'s ``rank<N>.log``, warm
starts: every start of a task's workers, and every restart of a script's, forked from a spare
per local rank that has imported torch, unless ``--no-warm-restart``). Three changes a
subclass of the agent makes:

- when a worker fails, its siblings get :data:`RESTART_GRACE` seconds (not 30) to exit before
  SIGKILL, since they will be restarted from the checkpoint anyway; a stalled rank (asleep
  inside a step) is therefore killed promptly;
- a worker that exits with :data:`distrun.plugin.EXIT_REQUEUE` (it saved a preemption checkpoint)
  or with a usage error (2) ends the run instead of being restarted;
- the first failure's rank and last lines are kept, so it is reported once.

``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` is always set: with the rendezvous store shared with
the workers, restarted workers read the previous attempt's keys and try to reach dead peers
(pytorch/pytorch#167288; on torch 2.13 a restart after a SIGKILL fails most times without it).
Each attempt's workers then get a new store on a fresh port chosen by rendezvous rank 0: on one
node this agent hosts it before the workers start (``TORCHELASTIC_USE_AGENT_STORE=True``, every
worker a client of a store already listening, so none waits out torch's connect backoff); across
nodes, worker rank 0 hosts it.

On one node both stores, the rendezvous store and each attempt's, listen only on the run's bind
address (127.0.0.1, :func:`distrun.plugin.bind_address`): they are served on sockets bound here, and
the workers' gloo sockets follow ``GLOO_SOCKET_IFNAME``.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from distrun.plugin import (
    EXIT_REQUEUE,
    GENERATION_ENV,
    LAUNCHER_PID_ENV,
    DistrunError,
    NodeRanks,
    Relay,
    UsageError,
    WarmPool,
    WorkerGroup,
    WorkerOutputs,
    exit_code,
    interface_addresses,
    listen_socket,
    resolve_host,
    serve_store,
    server_env,
    warm_command,
)
from distrun_elastic.liveness import Liveness, LostPeer, publish_generation
from distrun_elastic.settings import RESTART_GRACE, ElasticPlan

__all__ = ["launch_elastic"]

_USAGE_ERROR = 2
#: signals the launcher forwards to the workers (SIGUSR1: SLURM's --signal warning)
_FORWARDED = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
#: phrases of a rank that failed because a peer died first (not the root cause)
_SECONDARY = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")
#: the module every worker ``distrun run`` starts runs (a task, --script or --module after it)
WORKER_MODULE = "distrun._worker.main"


#: the signal the heartbeat thread sends the agent's main thread when the store is lost
_WAKE = signal.SIGUSR2
#: seconds the main thread gets to unwind after that signal before the process ends without it
UNWIND_GRACE = 2.0


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

    def __init__(self, *args: Any, relay: Relay, plan: ElasticPlan, host_store: bool = False,
                 bind: str | None = None, trains_task: bool = True,
                 outputs: WorkerOutputs | None = None, services: Sequence[Any] = (),
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.services = list(services)
        self.relay = relay
        #: where the workers' log and error files go (``--log-dir``, else a temporary folder)
        self.outputs = outputs or WorkerOutputs()
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
        #: the warm spares the workers are forked from (None: every start is cold)
        self.warm: WarmPool | None = None
        #: what starts the spares once the first workers have started (None: nothing to start)
        self.make_warm: Callable[[], WarmPool] | None = None
        self._ending = threading.Lock()
        self._rounds = 0

    def _rendezvous(self, worker_group: Any) -> None:
        self.stop_liveness()
        super()._rendezvous(worker_group)
        store = worker_group.store
        os.environ[GENERATION_ENV] = str(
            publish_generation(store, self.plan.run_id, worker_group.group_rank))
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
        self.outputs.cleanup()

    def stop_liveness(self) -> None:
        if self.liveness is not None:
            self.liveness.stop()
            self.liveness = None

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
            signals=os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", _FORWARDED))
        extra = {"TORCHELASTIC_USE_AGENT_STORE": str(spec.rdzv_handler.use_agent_store)}
        self.relay.new_attempt()  # a restarted group's tracebacks are printed again
        self.group = WorkerGroup([spec.entrypoint, *spec.args], ranks, environ=os.environ,
                                 extra_env=extra, outputs=self.outputs, relay=self.relay,
                                 warm=self.warm, services=self.services).start()
        _stop_with_signals()  # as torch's own process context does: SignalException in run()
        return {w.local_rank: w.proc.pid for w in self.group.workers}

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        if self.group is not None:
            self.group.stop(grace=float(timeout), signum=death_sig)

    def _monitor_workers(self, worker_group: Any) -> RunResult:
        if self.liveness is not None:
            lost = self.liveness.lost()
            if lost and self.root_cause is None:
                return self._lose(worker_group, lost)
        self._stop_siblings_of_failure(worker_group)
        result = self._result(worker_group)
        failed = result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY)
        if failed and self.root_cause and self.root_cause[1] == EXIT_REQUEUE and \
                _nodes_waiting(worker_group) > 0:
            # Not a stop of this run: a node joins, another node's agent stopped its workers
            # to re-form first, and ours stopped with them at the step boundary (the stop vote),
            # saving that step. Torch's loop re-forms for the waiting node next, as it would
            # have from a healthy group, and spends no restart.
            self.root_cause = None
            return RunResult(state=WorkerState.HEALTHY)
        if failed and self.root_cause:
            rank, code = self.root_cause
            if code in (EXIT_REQUEUE, _USAGE_ERROR):
                self._remaining_restarts = 0
            elif self._remaining_restarts > 0:
                self.restarts += 1
                _say(f"rank {rank} exited with code {exit_code(code)}; restarting the workers"
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

    def _result(self, worker_group: Any) -> RunResult:
        """The attempt's state from its workers' exits, as torch's agent reports it."""
        group = self.group
        if group is None:
            return RunResult(state=WorkerState.UNKNOWN)
        codes = group.poll()
        failures = {
            w.rank: ProcessFailure(local_rank=w.local_rank, pid=w.proc.pid, exitcode=code,
                                   error_file=group.outputs.error_file(w.rank) or "")
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
            self.group.signal_all(signal.SIGKILL)
            for w in self.group.workers:
                w.proc.wait()

    def _stop_siblings_of_failure(self, worker_group: Any) -> None:
        group = self.group
        if group is None or self.root_cause is not None:
            return
        failed = [(w.local_rank, c) for w, c in zip(group.workers, group.poll())
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
        # A requeue exit means a checkpoint was committed: the others are finishing the same.
        grace = float(self._shutdown_timeout) if code == EXIT_REQUEUE else RESTART_GRACE
        group.stop(grace=grace)


def trains_task(command: list[str]) -> bool:
    """True when ``command`` runs a task of the core's loop, whose checkpoints distrun holds
    (not ``--script``/``--module``, nor a program other than distrun's worker)."""
    for i, arg in enumerate(command[:-1]):
        if arg == "-m" and command[i + 1] == WORKER_MODULE:
            return len(command) > i + 2 and command[i + 2] not in ("--script", "--module")
    return False


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
    run() then stops the workers with that signal and :func:`launch_elastic` says how it ended."""
    if threading.current_thread() is not threading.main_thread():
        return

    def raise_it(signum: int, frame: Any) -> None:
        sig = signal.Signals(signum)
        raise SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)

    for name in os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", _FORWARDED).split(","):
        sig = getattr(signal, name.strip(), None)
        if sig is not None:
            signal.signal(sig, raise_it)


def _end_spares(pool: WarmPool) -> None:
    """End the warm spares at once: they hold nothing, and one that is still importing torch
    (a script's spares start with its first workers) would not read its socket's close until
    it is done; one that is idle would then tear down an interpreter that has imported torch.
    Either kept the launcher waiting seconds after the script's last line."""
    for pid in pool.pids().values():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    pool.close()


def _file_tail(path: str, nbytes: int = 8192) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, os.path.getsize(path) - nbytes))
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


def _signal(procs: list[Any], signum: int) -> None:
    for proc in procs:
        try:
            os.killpg(proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def _quiet_torch_logs(debug: bool) -> None:
    """torch's agent logs every step of its work; distrun says what matters in its own lines."""
    if debug or os.environ.get("LOGLEVEL"):
        return
    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _skip_join_skew() -> None:
    """Take out the random 0-0.3 s pause of torch's c10d rendezvous before a join, on one node.

    torch spreads the first joins of many nodes over 0.3 s so that they do not reach the store
    all at once, and it pauses again at the first restart (the round is still 0 then). On a
    single node there is nobody to spread: it only adds 0.15 s, on average, to the start and to
    the restart. Only that random pause goes; the 1 s pause between polls of a waiting join
    stays. This process runs one agent of one single-node run, so the change is its own.
    """
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    delay = getattr(dynamic_rendezvous, "_delay", None)
    if delay is None or getattr(delay, "distrun_no_skew", False):
        return

    def no_skew(seconds: float | tuple[float, float]) -> None:
        if not isinstance(seconds, tuple):  # (low, high): the random skew
            delay(seconds)

    no_skew.distrun_no_skew = True  # type: ignore[attr-defined]
    dynamic_rendezvous._delay = no_skew


def _workers_use_agent_store(handler: Any) -> None:
    """Tell the workers (``TORCHELASTIC_USE_AGENT_STORE=True``, which torch's agent takes from
    the handler) that the agent hosts their store: every rank connects as a client."""
    cls = type(handler)
    handler.__class__ = type(f"AgentStore{cls.__name__}", (cls,),
                             {"use_agent_store": property(lambda self: True)})


def _serve_rendezvous_store(plan: ElasticPlan) -> str:
    """The rendezvous endpoint, its store served here on the endpoint's address, when this
    node is the one at ``--rdzv-endpoint`` (every node of a single-node run is).

    torch's c10d and static rendezvous make a multi-tenant TCPStore on the endpoint's port: on
    the socket bound here they find this server instead of binding every interface. Elsewhere
    (another host serves it; or, on one machine, another launcher got the port first without
    ``is_host`` said) the endpoint is left to torch, which connects as a client.
    """
    host, port = parse_rendezvous_endpoint(plan.rdzv_endpoint, default_port=29400)
    said = plan.rdzv_configs.get("is_host")
    if said is not None and said.strip().lower() not in ("1", "true", "t", "yes", "y", "on"):
        return plan.rdzv_endpoint
    address = resolve_host(host)
    if plan.max_nodes > 1 and (address is None or not (
            ipaddress.ip_address(address).is_loopback
            or address in interface_addresses().values())):
        return plan.rdzv_endpoint  # the store's host is another one
    try:
        sock = listen_socket(plan.bind_address if plan.max_nodes == 1 else address, port)
    except UsageError:
        if said is not None or plan.max_nodes == 1:
            raise
        return plan.rdzv_endpoint  # another launcher on this machine serves it
    port = sock.getsockname()[1]
    serve_store(sock, host)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _prepare_environ(plan: ElasticPlan, environ: dict[str, str]) -> None:
    # The agent's workers inherit this process's environment (torch's SubprocessHandler).
    environ.update(server_env(plan.bind_address, environ))
    os.environ.update(environ)
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    # torch's SubprocessHandler starts the workers from this process's main thread: they die
    # with it (the worker entry point calls distrun.plugin.die_with_launcher).
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = plan.signals or _FORWARDED
    if plan.nproc_per_node > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")


def rendezvous_defaults(plan: ElasticPlan) -> dict[str, Any]:
    """torch's rendezvous timings that bound a re-form, derived from ``--heartbeat-timeout``.

    A re-form after a lost host waits for torch to drop the host from the rendezvous (its
    keep-alive expires after ``keep_alive_interval * keep_alive_max_attempt`` seconds: made
    no longer than the heartbeat timeout, so it has expired when distrun names the loss),
    then for ``last_call_timeout`` (torch's 30 s default would double the bound; late hosts
    still join through a scale-up), and a cut-off node's store calls give up after
    ``read_timeout`` (torch's 60 s). ``--rdzv-conf`` overrides each.
    """
    timeout = plan.heartbeat_timeout
    return {"keep_alive_interval": max(1, int(timeout // 3)), "keep_alive_max_attempt": 3,
            "last_call_timeout": 3, "read_timeout": max(5, int(timeout))}


def launch_elastic(plan: ElasticPlan, command: list[str], environ: dict[str, str],
                   services: Sequence[Any] = ()) -> int:
    """Run the workers of this node under the elastic agent; the exit code of the run.

    ``services``: what runs beside the workers (told of each start and end)."""
    _prepare_environ(plan, environ)
    _quiet_torch_logs(plan.debug)
    if plan.max_nodes == 1 and plan.rdzv_backend == "c10d":
        _skip_join_skew()
    configs = {"timeout": 900, **rendezvous_defaults(plan), **plan.rdzv_configs}
    endpoint = plan.rdzv_endpoint
    if plan.rdzv_backend in ("c10d", "static"):
        endpoint = _serve_rendezvous_store(plan)
    params = RendezvousParameters(
        backend=plan.rdzv_backend, endpoint=endpoint, run_id=plan.run_id,
        min_nodes=plan.min_nodes, max_nodes=plan.max_nodes, local_addr=plan.local_addr,
        **configs,
    )
    master_addr = master_port = None
    if plan.rdzv_backend == "static":
        master_addr, master_port = parse_rendezvous_endpoint(endpoint, default_port=-1)
    try:
        handler = rdzv_registry.get_rendezvous_handler(params)
    except (RendezvousError, ValueError, RuntimeError) as exc:
        raise DistrunError(f"cannot reach the rendezvous at {plan.rdzv_endpoint}: {exc} "
                           "(check --rdzv-endpoint; the node at HOST must be started)") from None
    spec = WorkerSpec(
        role=plan.role, local_world_size=plan.nproc_per_node, entrypoint=command[0],
        args=tuple(command[1:]), rdzv_handler=handler, max_restarts=plan.max_restarts,
        monitor_interval=plan.monitor_interval, master_addr=master_addr,
        master_port=master_port, local_addr=plan.local_addr,
    )
    host_store = plan.rdzv_backend == "c10d"
    if host_store:
        _workers_use_agent_store(handler)
    relay = Relay(tee=plan.tee)
    stop_grace = int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))
    task = trains_task(command)
    warm: WarmPool | None = None
    make_warm: Callable[[], WarmPool] | None = None
    if plan.warm_restart and warm_command(command) is not None:

        def spares() -> WarmPool:
            return WarmPool(command, plan.nproc_per_node, env=os.environ, debug=plan.debug)

        # A task's workers import what the spares preload (torch, its optimizers' torch._dynamo,
        # distrun's loop): started now, from this (main) thread, the spares import it during
        # the rendezvous and every start is forked from them. A script may need much less: its
        # first workers start cold, as under torchrun, rather than wait for that preload, and
        # the spares start after them, for the restarts.
        if task:
            warm = spares()
        else:
            make_warm = spares
    # the workers' output comes through pipes; torch's error files go into --log-dir, or a
    # folder of this run's own, removed when the run ends however it ends
    outputs = WorkerOutputs(log_dir=plan.log_dir or None,
                            error_dir=os.path.abspath(plan.log_dir) if plan.log_dir else None)
    if not plan.log_dir:
        outputs.error_dir = outputs.temporary = tempfile.mkdtemp(prefix="distrun_elastic_")
    agent = DistrunAgent(spec=spec, logs_specs=DefaultLogsSpecs(log_dir=os.devnull),
                         start_method="spawn", shutdown_timeout=stop_grace, relay=relay,
                         plan=plan, host_store=host_store, bind=plan.bind_address,
                         trains_task=task, outputs=outputs, services=services)
    agent.warm, agent.make_warm = warm, make_warm
    _quiet_torch_logs(plan.debug)
    shutdown_rdzv = True

    def woken(signum: int, frame: Any) -> None:
        agent.unwound.set()
        raise CutOff(plan.rdzv_endpoint, agent.cut_off_after or plan.heartbeat_timeout)

    previous = signal.signal(_WAKE, woken)
    try:
        result = agent.run()
    except SignalException as exc:
        # Keep the rendezvous open: a relaunch (requeue) or the other nodes may go on.
        shutdown_rdzv = False
        sig = exc.sigval
        if sig in (signal.SIGTERM, signal.SIGUSR1):
            saved = "saved a checkpoint and stopped" if agent.trains_task else "stopped"
            _say(f"{sig.name}: the workers {saved}; exit {EXIT_REQUEUE} (requeue)")
            return EXIT_REQUEUE
        return exit_code(-int(sig))
    except RendezvousGracefulExitError:
        return 0
    except CutOff as exc:
        shutdown_rdzv = False
        if agent.claim_end():  # else the heartbeat thread is saying it, and ending the process
            _say(str(exc))
        return EXIT_REQUEUE
    except RendezvousConnectionError:
        # torch's own store calls gave up first (--rdzv-conf read_timeout): the same loss
        shutdown_rdzv = False
        agent._kill_workers()
        if agent.claim_end():
            _say(str(CutOff(plan.rdzv_endpoint)))
        return EXIT_REQUEUE
    except RendezvousTimeoutError:
        join = configs.get("join_timeout", 600)
        raise DistrunError(
            f"rendezvous {plan.run_id!r} at {plan.rdzv_endpoint}: fewer than {plan.min_nodes} "
            f"node{'s' * (plan.min_nodes != 1)} joined within join_timeout={join} s (start "
            "the other nodes with the same --rdzv-endpoint and --rdzv-id, or give more time: "
            "--rdzv-conf join_timeout=SECONDS)") from None
    except RendezvousError as exc:
        raise DistrunError(f"rendezvous {plan.run_id!r} at {plan.rdzv_endpoint} failed: "
                           f"{exc or type(exc).__name__}") from None
    finally:
        agent.stop_liveness()
        if agent.warm is not None:
            _end_spares(agent.warm)
        signal.signal(_WAKE, previous)
        agent.remove_scratch()
        if shutdown_rdzv:
            try:
                handler.shutdown()
            except Exception:  # noqa: BLE001 - the run's result matters more than this
                pass
    if result is None or not result.is_failed():
        return 0
    return _report(agent, result)


def _report(agent: DistrunAgent, result: RunResult) -> int:
    if agent.root_cause is not None:
        rank, returncode = agent.root_cause
    else:
        first = min(result.failures.items(), key=lambda kv: kv[1].timestamp)
        rank, returncode = first[0], first[1].exitcode
    code = exit_code(returncode)
    if code == EXIT_REQUEUE:
        _say(f"the workers saved a checkpoint and stopped; exit {EXIT_REQUEUE} (requeue)")
        return code
    workers = agent.group.workers if agent.group is not None else []
    tail = next((w for w in workers if w.rank == rank), None)
    if agent.lost_peers:
        names = ", ".join(p.hostname for p in agent.lost_peers)
        _say(f"lost host {names} and no restarts left ({agent.restarts} used; "
             "--max-restarts N lets the run re-form without it)")
        return 1
    if agent.restarts:
        _say(f"no restarts left ({agent.restarts} used)")
    if tail is not None:
        agent.group.report(code, tail)  # type: ignore[union-attr]
    else:
        _say(f"rank {rank} failed with exit code {code}")
    return code
