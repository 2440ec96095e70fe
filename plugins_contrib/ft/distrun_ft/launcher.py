"""``distrun run --ft``: a lighthouse, N replica groups of K ranks, a dead group restarted alone.

Each replica group is a small torchrun world of its own (its ranks, its rendezvous store on the
run's address, its run folder ``RUN_DIR/replica<G>`` for the logs and ``metrics.csv``; the
checkpoint folder stays the run's). The groups meet only through torchft: the lighthouse this
launcher starts on loopback, or ``--ft-lighthouse HOST:PORT`` (served by the launcher of the
host that owns HOST, on HOST only, and used by every other one), and the cross-group process group each rank's
Manager forms at every quorum. When a rank dies the launcher stops the rest of its group at
once (so the group's heartbeat stops and the lighthouse drops it after ``--ft-heartbeat``
seconds) and starts the group again, up to ``--ft-max-restarts`` times; the other groups are
never stopped. The new group heals from a live peer (see :mod:`distrun_ft.loop`). A restarted
group starts with ``--resume auto`` (the run's newest checkpoint): when no group is live any more
(every group died) the launcher leaves an ``alone`` mark for each waiting replacement in the
meeting folder, and the replacements train on from the checkpoint instead of from step 0.

SIGINT or SIGTERM to the launcher is forwarded to every group: each saves (the lowest live
replica writes a preemption checkpoint) and exits; whatever still runs after
:attr:`WorkerGroup.STOP_GRACE <distrun.plugin.WorkerGroup.STOP_GRACE>` seconds is killed, and the launcher exits with
:data:`~distrun.plugin.EXIT_REQUEUE` (SIGTERM) or 130 (SIGINT), as the plain launcher does.

The lighthouse is the single point of failure of a run: when the one this launcher started
exits, no group can form a quorum again, so the launcher says so in one line, stops every
group and exits with :data:`~distrun.plugin.EXIT_REQUEUE` (run again with ``--resume auto``:
the run goes on from its newest durable checkpoint).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from distrun.plugin import (
    EXIT_REQUEUE,
    LOOPBACK,
    NodeRanks,
    NodeService,
    UsageError,
    WorkerGroup,
    bind_address,
    die_with_parent,
    exit_code,
    fresh_run_folder,
    listen_socket,
    resolve_nproc,
)
from distrun_ft.options import FtOptions
from distrun_ft.settings import lighthouse_here, lighthouse_hostport, timeouts

__all__ = ["launch_ft", "ADDRESS_ENV", "BARRIER_ENV", "REPLICA_ENV", "GROUPS_ENV", "LIGHTHOUSE_ENV", "ATTEMPT_ENV"]

#: the replica group a worker belongs to (0..N-1), how many the launcher runs, and how many
#: times this group was restarted
REPLICA_ENV = "DISTRUN_FT_REPLICA"
GROUPS_ENV = "DISTRUN_FT_GROUPS"
ATTEMPT_ENV = "DISTRUN_FT_ATTEMPT"
#: a folder where the first groups meet before their first quorum (see distrun_ft.replicas)
BARRIER_ENV = "DISTRUN_FT_START_BARRIER"
#: torchft's own variable: where the Manager of a group's rank 0 finds the lighthouse
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
#: the address this host's groups announce to the lighthouse and their peers
ADDRESS_ENV = "DISTRUN_FT_ADDRESS"
POLL = 0.05


@dataclass
class _Group:
    index: int
    workers: WorkerGroup | None = None  # its ranks, once started
    attempt: int = 0
    done: bool = False
    code: int = 0  # the exit code of its last failure (0: none)
    out_of_restarts: bool = False
    after_fit: bool = False  # it failed once its fit was done: the script's error, not a loss

    @property
    def procs(self) -> list[Any]:
        return [w.proc for w in self.workers.workers] if self.workers is not None else []

    def alive(self) -> bool:
        return self.workers is not None and self.workers.alive()

    def failed_rank(self) -> tuple[int, int] | None:
        for rank, p in enumerate(self.procs):
            if p.poll() not in (None, 0):
                return rank, int(p.returncode)
        return None

    def kill(self, signum: int) -> None:
        if self.workers is not None:
            self.workers.signal_all(signum)

    def end(self) -> None:
        """SIGKILL what still runs of the group, reap it, tell the node's services."""
        if self.workers is not None:
            self.workers.stop(grace=0.0, signum=signal.SIGKILL)


def _start_lighthouse(config: Any, bind: str = f"{LOOPBACK}:0") -> tuple[subprocess.Popen, str]:
    t = timeouts(config)
    min_replicas = int(FtOptions.of(config).ft_min_replicas)
    cmd = [sys.executable, "-u", "-m", "distrun_ft.lighthouse", bind,
           str(min_replicas), str(int(t.heartbeat * 1000)), str(int(t.heartbeat * 1000))]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")},
                            preexec_fn=die_with_parent())
    line = proc.stdout.readline().strip() if proc.stdout else ""  # its address, once bound
    if not line:
        proc.wait()
        raise UsageError(f"the torchft lighthouse did not start on {bind} (exit "
                         f"{proc.returncode}); check the torchft install: pip check")
    return proc, line


def _group_config(config: Any, g: int, attempt: int = 0) -> Any:
    values: dict[str, Any] = {}
    if attempt > 0 and config.resume in ("never", "auto"):
        # a restarted group holds nothing of the run's: it heals from a live peer, or, when
        # every group died, goes on from the run's newest checkpoint (never from step 0, which
        # would train the committed steps again and overwrite their checkpoints)
        values["resume"] = "auto"
    if not config.run_dir:
        return config.with_values(**values) if values else config
    values["run_dir"] = os.path.join(config.run_dir, f"replica{g}")
    ckpt_dir = config.get("ckpt_dir")  # the checkpoint plugin's option, when it is installed
    if ckpt_dir is not None:
        # one checkpoint folder for the run: any group may write it, every group reads it
        values["ckpt_dir"] = ckpt_dir or os.path.join(config.run_dir, "checkpoints")
    return config.with_values(**values)


def _start_group(group: _Group, config: Any, command: list[str], environ: dict[str, str],
                 nproc: int, lighthouse: str, groups: int, run_id: str,
                 barrier: str = "", address: str = LOOPBACK,
                 services: Sequence[NodeService] = ()) -> None:
    store = listen_socket(LOOPBACK, 0)
    ranks = NodeRanks(nproc=nproc, master_addr=LOOPBACK, master_port=store.getsockname()[1],
                      run_id=f"{run_id}-replica{group.index}", restart_count=group.attempt,
                      max_restarts=int(FtOptions.of(config).ft_max_restarts), bind=address,
                      config=_group_config(config, group.index, group.attempt),
                      workers_here=nproc * groups)
    extra = {REPLICA_ENV: str(group.index), GROUPS_ENV: str(groups), ADDRESS_ENV: address,
             ATTEMPT_ENV: str(group.attempt), LIGHTHOUSE_ENV: lighthouse,
             # every group shares the node's cores; torchft's servers log every quorum at info
             "OMP_NUM_THREADS": environ.get("OMP_NUM_THREADS", "1"),
             "RUST_LOG": environ.get("RUST_LOG", "warn")}
    if barrier:
        extra[BARRIER_ENV] = barrier
    # the workers write to this launcher's streams (relay=False): their lines as they come
    group.workers = WorkerGroup(command, ranks, environ=environ, extra_env=extra, store=store,
                                relay=False, services=services,
                                name=f"replica group {group.index}").start()


class _Stop:
    def __init__(self) -> None:
        self.signum: int | None = None

    def __call__(self, signum: int, frame: Any) -> None:
        self.signum = signum


def _say(line: str) -> None:
    sys.stderr.write(f"distrun: {line}\n")


def launch_ft(config: Any, command: list[str], environ: dict[str, str]) -> int:
    """Run the replica groups until they finish; the run's exit code."""
    nproc = resolve_nproc(config.nproc_per_node)
    n = int(FtOptions.of(config).replica_groups)
    if not config.run_dir:
        # A script that calls distrun.fit() makes its run folder in its workers, from the name
        # the launcher gave: every group would write the same metrics.csv (one's rename failed
        # on the other's). An --ft run always trains through distrun's loop, so it gets its
        # folder here, and each group its own replica<G> in it.
        config = fresh_run_folder(
            config.with_values(run_dir=os.path.join("runs", config.name or "run")))
    run_id = environ.get("TORCHELASTIC_RUN_ID") or config.name or "distrun"
    lighthouse_proc: subprocess.Popen | None = None
    address = LOOPBACK  # one host: everything on loopback
    if FtOptions.of(config).ft_lighthouse:
        host, port = lighthouse_hostport(FtOptions.of(config).ft_lighthouse)
        lighthouse = f"http://{host}:{port}"
        # groups on other hosts: this host's address on the route to the lighthouse (or
        # --local-addr)
        address = bind_address(2, host, config.local_addr)
        here = lighthouse_here(host, port)
        if here is not None:  # the URL names this host: serve the lighthouse here
            lighthouse_proc, _ = _start_lighthouse(config, f"{here}:{port}")
    else:
        lighthouse_proc, lighthouse = _start_lighthouse(config)
    first = int(FtOptions.of(config).ft_first_replica)
    if "stall_timeout" not in config.sources:
        # A group with a hung rank still heartbeats: the others wait for it in the quorum
        # (their watchers leave that wait alone: run.mark("quorum")) until its own watcher
        # names the rank and ends the group, and the lighthouse drops it. That must come
        # before the waiting groups give up (--timeout): the quorum's bound is the limit.
        config = config.with_values(stall_timeout=timeouts(config).quorum)
    services = config.node_services()  # told of every group's starts and ends
    groups = [_Group(first + g) for g in range(n)]
    stop = _Stop()
    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    # the groups' meeting folder: in the run folder when there is one, so a launcher killed
    # with -9 leaves it there rather than in /tmp
    if config.run_dir:
        os.makedirs(config.run_dir, exist_ok=True)
    barrier = tempfile.mkdtemp(prefix=".ft-meet-" if config.run_dir else "distrun-ft-",
                               dir=config.run_dir or None)
    try:
        for group in groups:
            _start_group(group, config, command, environ, nproc, lighthouse, n, run_id,
                         barrier=f"{barrier}:{n}", address=address, services=services)
        return _supervise(config, groups, command, environ, nproc, lighthouse, run_id, stop,
                          lighthouse_proc, f"{barrier}:{n}", address, services)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        for group in groups:
            group.end()
        if lighthouse_proc is not None:
            if lighthouse_proc.poll() is None:
                lighthouse_proc.terminate()
                try:
                    lighthouse_proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    lighthouse_proc.kill()
                    lighthouse_proc.wait()
            if lighthouse_proc.stdout is not None:
                lighthouse_proc.stdout.close()
        shutil.rmtree(barrier, ignore_errors=True)


def mark_name(what: str, replica: int | str, attempt: int | str) -> str:
    """The file a group's rank leaves in the meeting folder for the launcher: ``joined`` (a
    restarted group met its peers) or ``fitted`` (its fit is done; a failure after it is the
    script's, not a lost group), for replica group ``replica``'s start number ``attempt``."""
    return f"{what}-replica{replica}-attempt{attempt}"


def _stop_unjoined(groups: list[_Group], folder: str) -> None:
    """Once a group has finished the run, a restarted group that has not joined its peers yet
    has nobody left to heal from: it is stopped (it would only train the run again)."""
    for group in groups:
        if group.done or group.out_of_restarts or group.attempt == 0:
            continue
        if not os.path.exists(os.path.join(folder, mark_name("joined", group.index,
                                                             group.attempt))):
            group.end()
            group.done = True
            _say(f"replica group {group.index} was still waiting to rejoin when the others "
                 "finished the run: stopped")


def _waiting(group: _Group, folder: str) -> bool:
    """Whether ``group`` is a restarted group that has not met a peer yet."""
    return group.attempt > 0 and not group.done and not group.out_of_restarts and \
        not os.path.exists(os.path.join(folder, mark_name("joined", group.index, group.attempt)))


def _release_alone(groups: list[_Group], folder: str) -> None:
    """When every live group is a replacement waiting for a peer (every group died), nobody
    can heal them: each is told to go on from the run's newest checkpoint (see
    :mod:`distrun_ft.loop`). One that meets another replacement first heals from it (or it
    from the one). Only for a launcher that runs every group of the run (one host)."""
    live = [g for g in groups if not g.done and not g.out_of_restarts and g.alive()]
    if not live or not all(_waiting(g, folder) for g in live):
        return
    for group in live:
        path = os.path.join(folder, mark_name("alone", group.index, group.attempt))
        if not os.path.exists(path):
            open(path, "w").close()


def _stop_code(signum: int) -> int:
    """The exit code of a run stopped by ``signum``: requeue for SIGTERM, as the plain
    launcher's workers exit (130 for SIGINT)."""
    return 128 + signal.SIGINT if signum == signal.SIGINT else EXIT_REQUEUE


def _supervise(config: Any, groups: list[_Group], command: list[str], environ: dict[str, str],
               nproc: int, lighthouse: str, run_id: str, stop: _Stop,
               lighthouse_proc: subprocess.Popen | None, barrier: str, address: str,
               services: Sequence[NodeService] = ()) -> int:
    budget = int(FtOptions.of(config).ft_max_restarts)
    folder = barrier.rpartition(":")[0]  # the meeting folder (the spec ends in ":COUNT")
    stopping_since: float | None = None
    while True:
        if stop.signum is not None:
            if stopping_since is None:
                stopping_since = time.monotonic()
                for group in groups:
                    group.kill(stop.signum)
            if any(g.alive() for g in groups) and \
                    time.monotonic() - stopping_since <= WorkerGroup.STOP_GRACE:
                time.sleep(POLL)
                continue
            for group in groups:  # past the grace: what still runs is killed
                group.end()
            # a run that ended meanwhile stays 0, a usage error said by a worker stays 2
            codes = {exit_code(p.returncode) for g in groups for p in g.procs}
            if codes <= {0}:
                return 0
            return 2 if 2 in codes else _stop_code(stop.signum)
        if lighthouse_proc is not None and lighthouse_proc.poll() is not None:
            _say(f"the torchft lighthouse (pid {lighthouse_proc.pid}) exited with code "
                 f"{lighthouse_proc.returncode}: no replica group can form a quorum without it; "
                 f"stopping every group; run again with --resume auto to go on from the newest "
                 f"checkpoint (exit {EXIT_REQUEUE}, requeue)")
            return EXIT_REQUEUE
        for group in groups:
            if group.done or group.out_of_restarts:
                continue
            failed = group.failed_rank()
            if failed is None:
                if all(p.poll() == 0 for p in group.procs):
                    group.done = True
                continue
            rank, code = failed
            group.end()  # the rest of the group at once: its heartbeat stops with it
            group.code = exit_code(code)
            if group.code == 2:  # a usage error, said by the worker in one line: no restart
                return 2
            if os.path.exists(os.path.join(folder, mark_name("fitted", group.index,
                                                             group.attempt))):
                # its training was done: what failed is the script after fit, and a restart
                # would only fail the same way (the others go on to their own end)
                group.after_fit = group.out_of_restarts = True
                _say(f"replica group {group.index} finished training, then rank {rank} exited "
                     f"with code {code}: an error of the script after fit (its output is "
                     "above); not restarted")
                continue
            if group.attempt >= budget or any(g.done for g in groups):
                group.out_of_restarts = True
                _say(f"replica group {group.index} lost (rank {rank} exited with code {code}); "
                     f"no restart left (--ft-max-restarts {budget}): the other groups go on "
                     "without it")
                continue
            group.attempt += 1
            _say(f"replica group {group.index} lost (rank {rank} exited with code {code}): "
                 f"restarting it (restart {group.attempt} of {budget}); the other groups keep "
                 "training and it heals from one of them")
            _start_group(group, config, command, environ, nproc, lighthouse, len(groups),
                         run_id, barrier=barrier, address=address, services=services)
        if any(g.done for g in groups):
            _stop_unjoined(groups, folder)
        elif not FtOptions.of(config).ft_lighthouse:
            # (across hosts, groups of other launchers may be live: the waiting ones wait)
            _release_alone(groups, folder)
        if all(g.done or g.out_of_restarts for g in groups):
            scripts = [g.code for g in groups if g.after_fit]
            if scripts:
                return scripts[0]
            if any(g.done for g in groups):
                return 0
            return next(g.code for g in groups if g.out_of_restarts)
        time.sleep(POLL)
