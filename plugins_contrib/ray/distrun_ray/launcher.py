"""``distrun run --launcher ray``: one Ray actor per rank, torch's env:// rendezvous between them.

The launcher reserves one placement-group bundle per rank, places a :class:`RankHost` actor in
each, gives every rank torchrun's variables (rank 0's node address and a port free there as the
master) and streams the workers' lines back. Each rank's servers listen on its node's address
only, on one node or several (:func:`distrun.plugin.bind_address`): rank 0's actor binds the store's
socket there and hands it to its worker, and each rank's gloo gets its node address's
interface. When a rank fails the others are stopped, the rank and its last lines are reported
and, with ``--ray-max-restarts N``, the whole group starts
again with ``TORCHELASTIC_RESTART_COUNT`` raised and ``--resume auto`` (so a checkpoint plugin
continues from the newest checkpoint of the run).

A rank whose actor cannot be reached (its node died or was cut off) is the cause of the failure,
whatever its peers then reported (they lost their connection to it): the launcher names that
node in one line, and restarts on what the cluster has left, or, when the cluster cannot place
the group again within ``--ray-start-timeout``, says so in one line and exits with
:data:`~distrun.plugin.EXIT_REQUEUE` (the run resumes from its newest checkpoint when
started again).
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

from distrun.plugin import (
    EXIT_REQUEUE,
    NodeRanks,
    Relay,
    RunConfig,
    UsageError,
    WorkerGroup,
    exit_code,
)
from distrun_ray.options import RayOptions

__all__ = ["launch_ray", "forwarded_env"]

#: launcher variables handed to workers on every node (names starting with these)
FORWARD_PREFIXES = ("DISTRUN_", "TORCH", "NCCL_", "GLOO_", "OMP_", "MKL_", "PYTHONPATH",
                    "PYTHONUNBUFFERED", "PYTHONHASHSEED", "CUBLAS_")
POLL_SECONDS = 0.1
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


def forwarded_env(environ: dict[str, str], extra: str) -> dict[str, str]:
    """The launcher variables workers get: the prefixes above and the ``--ray-env`` names."""
    names = {n.strip() for n in extra.split(",") if n.strip()}
    return {k: v for k, v in environ.items() if k.startswith(FORWARD_PREFIXES) or k in names}


@dataclass
class _Rank:
    rank: int
    actor: Any
    ip: str
    host: str = ""  # the node's host name
    local_rank: int = 0
    local_world: int = 1
    node_rank: int = 0
    code: int | None = None
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=20))
    log: IO[str] | None = None
    err_tail: collections.deque[str] = field(  # its stderr lines
        default_factory=lambda: collections.deque(maxlen=20))
    lost: str | None = None  # why its actor cannot be reached (a Ray error's name)
    aborted: str | None = None  # why its group ended it (a stall's line, said already)

    @property
    def node_name(self) -> str:
        return f"{self.ip} ({self.host})" if self.host and self.host != self.ip else self.ip


class _NoRoom(Exception):
    """The cluster cannot place the group: the bundle asked for and what the cluster has."""


def _connect(config: RunConfig) -> Any:
    address = RayOptions.of(config).ray_address or os.environ.get("RAY_ADDRESS") or None
    if address and address.rpartition(":")[0] in LOOPBACK:
        # Ray rewrites 127.0.0.1 to the machine's outward address unless told the cluster is
        # local-only; a head started on 127.0.0.1 listens there only. Read when ray is imported.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    try:
        ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR,
                 include_dashboard=False if address is None else None,
                 configure_logging=True)
    except ConnectionError as exc:
        raise UsageError(f"cannot connect to the Ray cluster at {address}: {exc} "
                         "(check --ray-address, or start one with `ray start --head`)") from None
    return ray


def _place(ray: Any, config: RunConfig, n: int) -> tuple[Any, list[_Rank]]:
    """Reserve ``n`` bundles, put a RankHost in each, and number the ranks node by node."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from distrun_ray.actor import RankHost

    opts = RayOptions.of(config)
    bundle: dict[str, float] = {"CPU": opts.ray_cpus_per_worker}
    if opts.ray_gpus_per_worker:
        bundle["GPU"] = opts.ray_gpus_per_worker
    pg = placement_group([dict(bundle) for _ in range(n)], strategy=opts.ray_placement)
    try:
        ray.get(pg.ready(), timeout=opts.ray_start_timeout)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        have = ray.cluster_resources()
        raise _NoRoom(f"{n} workers of {bundle}",
                      f"CPU={have.get('CPU', 0):g}, GPU={have.get('GPU', 0):g}") from None
    remote = ray.remote(RankHost)
    actors = [remote.options(
        num_cpus=opts.ray_cpus_per_worker, num_gpus=opts.ray_gpus_per_worker or None,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=i)).remote() for i in range(n)]
    nodes = ray.get([a.node.remote() for a in actors], timeout=opts.ray_start_timeout)
    # torchrun's numbering: ranks of one node are consecutive, nodes in order of appearance.
    order: dict[str, list[int]] = {}
    for i, (_, node_id, _) in enumerate(nodes):
        order.setdefault(node_id, []).append(i)
    ranks: list[_Rank] = []
    for node_rank, members in enumerate(order.values()):
        for local, i in enumerate(members):
            ranks.append(_Rank(len(ranks), actors[i], nodes[i][0], nodes[i][2], local,
                               len(members), node_rank))
    return pg, ranks


class _Stop:
    """SIGINT/SIGTERM to the launcher: forwarded to every worker, no restart afterwards."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.since: float | None = None

    def __call__(self, signum: int, frame: Any) -> None:
        self.signum = signum
        self.since = self.since or time.monotonic()


def _run_group(ray: Any, ranks: list[_Rank], stop: _Stop, relay: Relay) -> _Rank | None:
    """Wait for every rank, their output on ``relay``; the first failed one (the others are
    stopped), or None."""
    forwarded = False
    said: set[tuple[str, ...]] = set()  # the node services' lines said (one per stall)
    while True:
        live = [r for r in ranks if r.code is None]
        if not live:
            return None
        if stop.signum is not None and not forwarded:
            for r in live:
                r.actor.signal.remote(stop.signum)
            forwarded = True
        if stop.since is not None and time.monotonic() - stop.since > WorkerGroup.STOP_GRACE:
            _stop_ranks(ray, live, grace=0.0)
        for r in live:
            try:
                lines, code, aborted = ray.get(r.actor.poll.remote(), timeout=60)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                r.lost, lines, code, aborted = type(exc).__name__, [], -int(signal.SIGKILL), None
            r.aborted = r.aborted or aborted
            for stream, text in lines:
                if stream == "say":
                    # each rank's group has a watcher, and each prints the whole picture of
                    # a stall (as each node's launcher does): said once, "error: stall at
                    # step 20" the key
                    key = tuple(text.split(": ", 2)[:2])
                    if key not in said:
                        said.add(key)
                        relay.say(text.rstrip("\n"))
                    continue
                relay.emit(r, text, sys.stdout if stream == "out" else sys.stderr)
            if code is not None:  # its output is over: a last line without its newline too
                relay.flush(r, sys.stdout)
                relay.flush(r, sys.stderr)
            r.code = code
        failed = [r for r in ranks if r.code not in (None, 0)]
        if failed and stop.signum is None:
            _stop_ranks(ray, [r for r in ranks if r.code is None], grace=5.0)
            # The root cause, not the ranks that merely lost their peers when it died: a rank
            # on a lost node (found now, or while stopping the others), else one that failed
            # by itself rather than by a signal.
            failed = [r for r in ranks if r.lost or r.code not in (None, 0)]
            return min(failed, key=lambda r: (r.lost is None, r.code in (-9, -15), r.rank))
        if stop.signum is not None and all(r.code is not None for r in ranks):
            return next((r for r in ranks if r.code != 0), None)
        time.sleep(POLL_SECONDS)


def _stop_ranks(ray: Any, ranks: list[_Rank], grace: float) -> None:
    """Stop these ranks' workers; a rank whose actor does not answer is marked lost."""
    calls = [(r, r.actor.stop.remote(grace)) for r in ranks]
    deadline = time.monotonic() + grace + 60
    for r, call in calls:
        try:
            ray.get(call, timeout=max(0.1, deadline - time.monotonic()))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            r.lost = type(exc).__name__
        except ray.exceptions.RayError:
            pass


def _say_lost(r: _Rank, last: bool) -> None:
    then = (f"; no restart left (--ray-max-restarts): run again with --resume auto; exit "
            f"{EXIT_REQUEUE} (requeue)") if last else ""
    sys.stderr.write(
        f"distrun: lost Ray node {r.node_name} with rank {r.rank}: its actor cannot be "
        f"reached ({r.lost}): the node stopped or its network is down{then}\n"
    )


def launch_ray(config: RunConfig, command: list[str], environ: dict[str, str]) -> int:
    """Run the job on Ray; the exit code of the first failing rank, else 0."""
    ray = _connect(config)
    from ray.util.placement_group import remove_placement_group

    opts = RayOptions.of(config)
    n = opts.ray_num_workers or config.world_size_requested or 1
    restarts = opts.ray_max_restarts
    if restarts == 0 and "ray_max_restarts" not in config.sources:
        restarts = int(config.get("max_restarts") or 0)  # the elastic plugin's flag, if any
    base = forwarded_env(environ, opts.ray_env)
    run_id = environ.get("TORCHELASTIC_RUN_ID") or config.name
    stop = _Stop()
    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    pg: Any = None
    ranks: list[_Rank] = []
    lost: list[str] = []  # the nodes lost so far
    # The run's last word is said after ray.shutdown(): until then Ray's log monitor may still
    # relay a dead node's raylet dump, which would bury the line that says what to do.
    last_word: list[Callable[[], None]] = []
    try:
        for attempt in range(restarts + 1):
            try:
                pg, ranks = _place(ray, config, n)
            except _NoRoom as exc:
                asked, have = exc.args
                if attempt == 0:
                    raise UsageError(
                        f"the Ray cluster cannot place {asked} within "
                        f"{opts.ray_start_timeout:g}s (it has {have}); lower "
                        "--ray-num-workers or --ray-cpus-per-worker, or add nodes") from None
                message = (f"distrun: the Ray cluster cannot place {asked} "
                           f"({opts.ray_placement}) again within {opts.ray_start_timeout:g}s "
                           f"(it has {have}) after "
                           f"{'losing ' + ', '.join(lost) if lost else 'the failure above'}: "
                           "add a node (or restart the lost one) and run again with --resume "
                           f"auto; exit {EXIT_REQUEUE} (requeue)")
                last_word.append(functools.partial(print, message, file=sys.stderr, flush=True))
                return EXIT_REQUEUE
            master_ip = ranks[0].ip
            nnodes = len({r.node_rank for r in ranks})
            # every server on its node's address as Ray knows it, never every interface
            port = ray.get(ranks[0].actor.store_port.remote(master_ip), timeout=60)
            cfg = config if attempt == 0 or config.resume != "never" else \
                config.with_values(resume="auto")
            log_dir = os.path.join(config.run_dir, "logs") if config.run_dir else None
            if log_dir:
                os.makedirs(log_dir, exist_ok=True)
            starts = []
            # each actor's group gets its own copy; a restart places new actors, so nothing
            # that a service keeps for the next start would be read (the memory tier)
            services = [s for s in cfg.node_services()
                        if not getattr(s, "across_restarts", False)]
            for r in ranks:
                layout = NodeRanks(
                    nproc=r.local_world, nnodes=nnodes, node_rank=r.node_rank, world_size=n,
                    first_rank=r.rank - r.local_rank, local_ranks=(r.local_rank,),
                    master_addr=master_ip, master_port=port, run_id=run_id,
                    restart_count=attempt, max_restarts=restarts, config=cfg.to_json())
                if log_dir:
                    r.log = open(os.path.join(log_dir, f"rank{r.rank}.log"), "a")  # noqa: SIM115
                starts.append(r.actor.start.remote(command, layout, base, os.getcwd(), r.ip,
                                                   services))
            ray.get(starts, timeout=120)
            relay = Relay(tee=config.tee)
            failed = _run_group(ray, ranks, stop, relay)
            _release(ray, ranks, pg, remove_placement_group)
            pg = None
            if failed is None:
                return 0
            code = exit_code(failed.code if failed.code is not None else 1)
            if stop.signum is not None:
                return code
            final = attempt == restarts
            if any(r.aborted for r in ranks) and not failed.lost:
                code = 1  # a stall: its line is said, the run ends as a timeout ends it
            elif failed.lost:
                if final:
                    last_word.append(functools.partial(_say_lost, failed, last=True))
                else:
                    _say_lost(failed, last=False)
                lost.append(f"node {failed.node_name}")
                code = EXIT_REQUEUE  # nothing failed in the job: it can go on elsewhere
            elif final:
                last_word.append(functools.partial(relay.report, failed, code,
                                                   where=f"Ray node {failed.ip}"))
            else:
                relay.report(failed, code, where=f"Ray node {failed.ip}")
            if attempt < restarts:
                sys.stderr.write(
                    f"distrun: restarting all {n} ranks on Ray (restart {attempt + 1} of "
                    f"{restarts}), resuming from the newest checkpoint\n"
                )
        return code
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        if pg is not None:
            _release(ray, ranks, pg, remove_placement_group)
        ray.shutdown()
        for say in last_word:
            say()


def _release(ray: Any, ranks: list[_Rank], pg: Any, remove: Any) -> None:
    for r in ranks:
        if r.log is not None:
            r.log.close()
            r.log = None
        try:
            ray.kill(r.actor)
        except Exception:  # already gone with its node
            pass
    try:
        remove(pg)
    except Exception:
        pass
