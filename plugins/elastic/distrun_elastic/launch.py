"""Launch this node's workers under distrun's elastic agent (imports torch).

This mirrors ``torch.distributed.launcher.api.launch_agent`` (rendezvous handler, worker spec,
:class:`distrun_elastic.agent.DistrunAgent`, torch's ``LocalElasticAgent``), and holds what
surrounds the agent: the process's environment, the rendezvous store and its timings, the warm
spares, and the one line that says how the run ended.

``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` is always set: with the rendezvous store shared with
the workers, restarted workers read the previous attempt's keys and try to reach dead peers
(pytorch/pytorch#167288; on torch 2.13 a restart after a SIGKILL fails most times without it).
Each attempt's workers then get a new store on a fresh port chosen by rendezvous rank 0 (see
:mod:`distrun_elastic.agent`).

On one node both stores, the rendezvous store and each attempt's, listen only on the run's bind
address (127.0.0.1, :func:`distrun.plugin.bind_address`): they are served on sockets bound here, and
the workers' gloo sockets follow ``GLOO_SOCKET_IFNAME``.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import socket
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerSpec
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
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
    DistrunError,
    UsageError,
    WorkerGroup,
    exit_code,
    listen_socket,
    local_address,
    serve_store,
)
from distrun_elastic.agent import _FORWARDED, _WAKE, CutOff, DistrunAgent, _say
from distrun_elastic.settings import ElasticPlan

__all__ = ["launch_elastic"]

#: the module every worker ``distrun run`` starts runs (a task, --script or --module after it)
WORKER_MODULE = "distrun._worker.main"


def trains_task(command: list[str]) -> bool:
    """True when ``command`` runs a task of the core's loop, whose checkpoints distrun holds
    (not ``--script``/``--module``, nor a program other than distrun's worker)."""
    for i, arg in enumerate(command[:-1]):
        if arg == "-m" and command[i + 1] == WORKER_MODULE:
            return len(command) > i + 2 and command[i + 2] not in ("--script", "--module")
    return False


def _end_spares(pool: Any) -> None:
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


def _name_events_from_frames() -> None:
    """Name the rendezvous's events from the caller's frame, not from ``inspect.stack()``.

    torch's dynamic rendezvous records an event at each step of a round, named after the
    method that records it: ``get_method_name()`` builds the whole stack twice for that, with
    the source lines of every frame (``inspect.stack()`` reads them): 0.04 s of a restart's
    round here, with 2 ranks (the events go nowhere unless an events handler is set). The
    frame ``depth`` levels up names the same method, read from the frame itself.
    """
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    named = getattr(dynamic_rendezvous, "get_method_name", None)
    if named is None or getattr(named, "distrun_from_frame", False):
        return

    def get_method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name
        except ValueError:  # a stack less deep (as torch's own says)
            return "no_method_name"

    get_method_name.distrun_from_frame = True  # type: ignore[attr-defined]
    dynamic_rendezvous.get_method_name = get_method_name


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
    try:
        address: str | None = socket.gethostbyname(host)
    except OSError:
        address = None
    if plan.max_nodes > 1 and (address is None or not (
            ipaddress.ip_address(address).is_loopback or local_address(address))):
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
    # The workers' environment is this process's (the worker group adds torchrun's variables,
    # the servers' address and the lifeline: the workers die with this process's main thread).
    os.environ.update(environ)
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = plan.signals or _FORWARDED


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
    _name_events_from_frames()
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
    stop_grace = int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))
    task = trains_task(command)
    warm: Any = None
    make_warm: Callable[[], Any] | None = None
    if plan.warm_restart:

        def spares() -> Any:
            return WorkerGroup.spares(command, plan.nproc_per_node, environ=os.environ,
                                      debug=plan.debug)

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
    scratch = None if plan.log_dir else tempfile.mkdtemp(prefix="distrun_elastic_")
    agent = DistrunAgent(spec=spec, logs_specs=DefaultLogsSpecs(log_dir=os.devnull),
                         start_method="spawn", shutdown_timeout=stop_grace,
                         plan=plan, host_store=host_store, bind=plan.bind_address,
                         trains_task=task, log_dir=plan.log_dir or None,
                         error_dir=os.path.abspath(plan.log_dir) if plan.log_dir else scratch,
                         scratch=scratch, services=services)
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
    if agent.group is not None and agent.group.aborted:
        return 1  # the ranks stalled: the stall line said who; exit as a timeout would
    if tail is not None:
        agent.group.report(code, tail)  # type: ignore[union-attr]
    else:
        _say(f"rank {rank} failed with exit code {code}")
    return code
