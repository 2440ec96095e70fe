"""The stall watcher: a node service that names the rank a stuck run waits for.

Beside every worker group (one per node, under every launcher that starts groups: local,
elastic, distrun-ft) a thread of the launcher reads its ranks' position records once a second.
Once some rank finished a step or a collective, a run in which no rank moved for
``--stall-timeout`` seconds, and no rank's processes work (:mod:`distrun._diagnose.processes`:
a long checkpoint save of one rank is slow, not stalled), is stalled: the watcher asks every rank for its stacks, writes
them with each rank's state and position to ``RUN/stall-N/`` and prints one line that names
the culprit (:mod:`distrun._diagnose.summary`). Then it ends the workers (``--on-stall
stop``: the run fails with exit 1 as a collective timeout would, and ``--max-restarts``
restarts it from its checkpoint) or leaves them (``wait``: the collective timeout decides).

The default limit follows the run: max(60 s, 20 steps at the slowest rank's pace), and stays
under ``--timeout`` (a collective's own limit would end the run first, with no diagnosis).
Torch-free.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import socket
import sys
import tempfile
import threading
import time
from types import SimpleNamespace
from typing import Any

from distrun._diagnose.position import Phase, Position, read_position
from distrun._diagnose.processes import busy_sessions, process_state
from distrun._diagnose.stacks import dump_stacks
from distrun._diagnose.summary import RankView, report_of, summarize, views_of, write_evidence

__all__ = ["COLLECT", "StallWatcher", "across_nodes", "diagnose_group", "evidence_folder",
           "live_runs", "node_views", "stall_limit", "under_timeout"]

#: the default limit: at least this many seconds, and this many steps of the slowest rank
MIN_STALL = 60.0
STEPS = 20
#: the default limit stays under this share of --timeout ...
UNDER_TIMEOUT = 0.8
#: ... and this many seconds under it: the watcher's own look (a poll, the look at the
#: processes, the stacks) fits before a collective's timeout ends the run undiagnosed
DETECT = 6.0
#: seconds a rank collects the other nodes' reports (:mod:`distrun._diagnose.exchange`)
COLLECT = 10.0


def stall_limit(configured: float, timeout: float, positions: list[Position]) -> float:
    """The seconds without progress that make a stall (0: never)."""
    if configured >= 0:
        return configured
    step = max((p.step_seconds for p in positions), default=0.0)
    return min(max(MIN_STALL, STEPS * step), under_timeout(timeout))


def under_timeout(timeout: float) -> float:
    """The longest default limit for ``--timeout``: the stall is named before it ends the
    run (0.8 of it, and :data:`DETECT` seconds under it; half of a very short one)."""
    return max(min(UNDER_TIMEOUT * timeout, timeout - DETECT), 0.5 * timeout)


def evidence_folder(parent: str, base: str = "stall", node: int | None = None,
                    count: int = 0, unit: str = "node") -> str:
    """A new ``stall-N`` folder's path in ``parent`` (the run folder, else the log folder;
    "": the temporary folder, as for a plain script without ``--name``). One node of
    several: ``stall-<its count>-node<K>`` (the nodes may share the run folder);
    ``-rank<K>`` where a launcher starts each rank (``unit``)."""
    prefix = base
    if not parent:
        parent, prefix = tempfile.gettempdir(), f"distrun-{base}-{os.getpid()}"
    if node is not None:
        return os.path.join(parent, f"{prefix}-{count}-{unit}{node}")
    n = 1 + sum(1 for _ in glob.glob(os.path.join(parent, f"{prefix}-*")))
    while os.path.exists(os.path.join(parent, f"{prefix}-{n}")):
        n += 1
    return os.path.join(parent, f"{prefix}-{n}")


def across_nodes(folder: str, ranks: list[int], views: list[Any], nnodes: int, node: int,
                 key: str) -> tuple[list[Any], str]:
    """Every node's views (:class:`~distrun._diagnose.summary.RankView`): this node's
    ``views`` handed to its ``ranks`` through their FIFOs in ``folder``, which share them
    through the run's store; this node's alone when no rank answers in time. And the nodes
    that did not report ("0", "0,2"; "": none). The other nodes' ranks are asked too, and
    answer with their node's report whether or not their own watcher saw a stall (it may see
    it later than this node waits; ``distrun stacks`` finds no stall at all)."""
    with open(os.path.join(folder, f"node-{key}.json"), "w") as fh:
        json.dump(report_of(views, time.monotonic()), fh)
    line = f"{key}\n".encode()
    for rank in ranks:
        with contextlib.suppress(OSError):
            fd = os.open(os.path.join(folder, f"rank{rank}.ask"), os.O_WRONLY | os.O_NONBLOCK)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
    path = os.path.join(folder, f"reports-{key}.json")
    deadline = time.monotonic() + COLLECT + 3.0
    reports: dict[str, Any] = {}
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            with open(path) as fh:
                reports = json.load(fh)
            if len(reports) >= nnodes:
                break
        time.sleep(0.1)
    mine = {v.rank for v in views}
    now = time.monotonic()
    others = [v for name, report in sorted(reports.items())
              if int(name) != node for v in views_of(report, now) if v.rank not in mine]
    unseen = ",".join(str(n) for n in range(nnodes) if n != node and str(n) not in reports)
    return sorted(views + others, key=lambda v: v.rank), unseen


def diagnose_group(folder: str, ranks: dict[int, tuple[int, int | None]],
                   host: str) -> list[RankView]:
    """Every rank of one node, as :class:`RankView`: ``ranks`` maps a rank to (pid, exit code
    or None while it runs); the positions and stacks come from ``folder``."""
    views: list[RankView] = []
    targets: dict[int, tuple[int, str]] = {}
    for rank, (pid, code) in sorted(ranks.items()):
        pos = read_position(os.path.join(folder, f"rank{rank}"))
        state = f"exited {code}" if code is not None else process_state(pid)
        if pos is not None and pos.pid != pid and state == "running":
            pid = pos.pid  # a launcher that starts the rank through a wrapper process
            state = process_state(pid)
        views.append(RankView(rank, host, pid, state, pos))
        if state == "running" and pos is not None and pos.armed:
            targets[rank] = (pid, os.path.join(folder, f"rank{rank}.stacks"))
    stacks = dump_stacks(targets) if targets else {}
    for v in views:
        v.stacks = stacks.get(v.rank)
        if v.rank in targets and v.stacks is None and process_state(v.pid) == "stopped":
            v.state = "stopped"
    return views


def node_views(folder: str, look_busy: bool = False) -> list[RankView]:
    """Every rank of this node that keeps a record in ``folder``, as :class:`RankView`
    (``distrun stacks``, and a rank that answers another node's request for it).
    ``look_busy``: first see which of them work (:attr:`RankView.busy`), a moment's look."""
    ranks: dict[int, tuple[int, int | None]] = {}
    try:
        names = sorted(os.listdir(folder))
    except OSError:  # the group's workers ended meanwhile
        return []
    for name in names:
        if name.startswith("rank") and name[4:].isdigit():
            pos = read_position(os.path.join(folder, name))
            if pos is not None:
                ranks[pos.rank] = (pos.pid, None)
    if not ranks:
        return []
    # (before the stacks: answering them is work. A rank leads its session, as the group
    # starts it; one that does not is never said busy, as by the node's own watcher)
    busy = busy_sessions({pid for pid, _ in ranks.values() if _leads(pid)}) if look_busy \
        else set()
    views = diagnose_group(folder, ranks, socket.gethostname())
    for v in views:
        v.busy = ranks[v.rank][0] in busy and v.state == "running"
    return views


def _leads(pid: int) -> bool:
    try:
        return os.getsid(pid) == pid
    except OSError:
        return False


#: what a positions folder says of its run, for ``distrun stacks RUN``
RUN_FILE = "run.json"


def _describe_run(folder: str, config: Any, group: Any) -> None:
    run_dir = getattr(config, "run_dir", "")
    node, nnodes = _part(group)
    info = {"run_dir": os.path.abspath(run_dir) if run_dir else "",
            "name": getattr(config, "name", ""), "log_dir": getattr(config, "log_dir", ""),
            "host": socket.gethostname(), "group": getattr(group, "name", ""),
            "nnodes": nnodes, "node_rank": node, "unit": _unit(group)}
    with contextlib.suppress(OSError), open(os.path.join(folder, RUN_FILE), "w") as fh:
        json.dump(info, fh)


def live_runs() -> list[tuple[str, dict[str, Any]]]:
    """The worker groups alive on this host: (positions folder, what :data:`RUN_FILE`
    says of the run), those whose launcher is alive (and named this host: the testbed's
    hosts share one temporary folder)."""
    out = []
    here = socket.gethostname()
    for path in sorted(glob.glob(os.path.join(tempfile.gettempdir(), "distrun-positions-*"))):
        pid = os.path.basename(path)[len("distrun-positions-"):].split("-")[0]
        if not pid.isdigit() or not os.path.exists(f"/proc/{pid}"):
            continue
        try:
            with open(os.path.join(path, RUN_FILE)) as fh:
                info = json.load(fh)
        except (OSError, ValueError):
            info = {}
        if info.get("host", here) == here:
            out.append((path, info))
    return out


def _part(group: Any) -> tuple[int, int]:
    """(index, count) of ``group`` among the run's groups of workers, whose stall reports
    meet across them: its node and the nodes, or its rank and the world where a launcher
    starts each rank (``NodeRanks.part``)."""
    part = getattr(getattr(group, "ranks", None), "part", None)
    return (int(part[0]), int(part[1])) if part else (0, 1)


def _unit(group: Any) -> str:
    """What the index of :func:`_part` counts (``NodeRanks.unit``): ``node``, or ``rank``
    where a launcher starts each rank (the words of the lines and folders)."""
    return str(getattr(getattr(group, "ranks", None), "unit", "node"))


def _failing(group: Any) -> bool:
    """A rank failed (or all ended): the group's own wait reports it, not a stall. (A rank
    that exited 0 while the others wait for it is a stall, and is named so.)"""
    codes = group.poll()
    return all(c is not None for c in codes) or any(c not in (None, 0) for c in codes)


class StallWatcher:
    """A :class:`~distrun.plugin.NodeService`: watches one group's ranks while they run."""

    def __init__(self, config: Any) -> None:
        # the settings it reads, not the config: a Ray actor's group takes it to its process
        self.config = SimpleNamespace(**{k: getattr(config, k, "") for k in
                                         ("run_dir", "log_dir", "name")})
        self.configured = float(getattr(config, "stall_timeout", -1.0))
        self.timeout = float(getattr(config, "timeout", 300.0))
        self.wait_on = getattr(config, "on_stall", "stop") == "wait"
        self.host = socket.gethostname()
        #: each watched group's thread and its stop (a launcher may run several groups on a
        #: node with the same services: --ft's replica groups)
        self._watching: dict[int, tuple[threading.Thread, threading.Event]] = {}
        #: the last stall's line (None: none so far)
        self.summary: str | None = None
        self.count = 0  # looks across nodes so far: the key of each one's reports
        self.stalls = 0  # stalls said so far (stall-N folders)
        self.busy_count = 0  # busy ranks said so far (busy-N folders)

    def started(self, group: Any) -> None:
        if not getattr(group, "positions", None):
            return
        _describe_run(group.positions, self.config, group)
        if self.configured == 0:
            return
        stop = threading.Event()
        thread = threading.Thread(target=self._watch, args=(group, stop),
                                  name="distrun-stall-watcher", daemon=True)
        self._watching[id(group)] = (thread, stop)
        thread.start()

    def ended(self, group: Any) -> None:
        thread, stop = self._watching.pop(id(group), (None, None))
        if stop is not None:
            stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10.0)

    def _watch(self, group: Any, stop: threading.Event) -> None:
        last: dict[int, Position] = {}
        moved_at = time.monotonic()
        armed = reported = warned = False
        poll = 1.0 if self.configured < 0 else min(1.0, max(0.05, self.configured / 10))
        while not stop.wait(poll):
            folder = group.positions
            if folder is None:  # the workers ended (the group removed their records)
                return
            positions = {w.rank: p for w in list(group.workers)
                         if (p := read_position(os.path.join(folder, f"rank{w.rank}")))
                         is not None}
            now = time.monotonic()
            if any(p.moved(last.get(r)) for r, p in positions.items()):
                moved_at, reported, warned = now, False, False
            last = positions
            if not armed:
                armed = any(p.step > 0 or p.seq > 0 for p in positions.values())
                moved_at = now
                continue
            limit = stall_limit(self.configured, self.timeout, list(positions.values()))
            if reported or not limit or now - moved_at < limit:
                continue
            if positions and all(p.phase == Phase.QUORUM for p in positions.values()):
                # every rank waits for the other replica groups (--ft): a stall there is
                # theirs, named by their watchers, and torchft's timeouts bound this wait
                moved_at = now
                continue
            if _failing(group):
                return  # a rank failed: the group's own wait names it
            running = {w.proc.pid: w.rank for w in group.workers if w.proc.poll() is None}
            busy = busy_sessions(set(running))
            if busy:
                # slow, not stalled: a rank works (processes.py); look again in a quarter.
                # While the others wait, said once: a livelock looks the same
                if not warned and len(busy) < len(running):
                    warned = True
                    self._busy(group, sorted(running[pid] for pid in busy))
                moved_at = time.monotonic() - 0.75 * limit
                continue
            if _failing(group):  # (during the look at the processes)
                return
            views, unseen = self._look(group)
            elsewhere = sorted(v.rank for v in views if v.busy)
            if elsewhere:
                # another node's rank works while these wait (a node of srun's tasks or
                # Ray's actors holds one rank: the only place its work shows is here)
                if not warned:
                    warned = True
                    self._busy(group, elsewhere, views, unseen)
                moved_at = time.monotonic() - 0.75 * limit
                continue
            # No look at the exits here: the stall was there before the look, and a rank that
            # failed during it (up to the collect window) most likely failed of the stall's
            # end on another node (its launcher stopped its ranks: the connection dropped).
            # That failure is named by the group's wait; the stall is said here all the same,
            # where it used to depend on which came first (a flaky multi-host test).
            reported = True
            self._stalled(group, views, unseen)
            if not self.wait_on:
                return

    def _views(self, group: Any) -> list[RankView]:
        """This node's ranks, their positions and stacks."""
        codes = group.poll()
        return diagnose_group(group.positions, {w.rank: (w.proc.pid, c) for w, c in
                                                zip(group.workers, codes)}, self.host)

    def _look(self, group: Any) -> tuple[list[RankView], str]:
        """Every rank of the run: this node's, and the other nodes' as they answered (with
        whether they work); and the nodes that did not answer (:func:`across_nodes`)."""
        views = self._views(group)
        node, nnodes = _part(group)
        if nnodes < 2:
            return views, ""
        self.count += 1
        return across_nodes(group.positions, [w.rank for w in group.workers], views, nnodes,
                            node, str(self.count))

    def _busy(self, group: Any, ranks: list[int], views: list[RankView] | None = None,
              unseen: str = "") -> None:
        """Ranks ``ranks`` burn CPU past the limit while the others wait for them: a
        warning line with their stacks (``views``: every node's; else this node's); the run
        goes on, and the collective timeout ends it unless they finish."""
        self.busy_count += 1
        who = f"rank {ranks[0]} burns" if len(ranks) == 1 else \
            f"ranks {','.join(map(str, ranks))} burn"
        why = (f"{who} CPU while the others wait: a livelock, or work longer than they wait "
               f"(the collective timeout, {self.timeout:g} s, ends the run unless it finishes)")
        line = self._told(group, "busy", self.busy_count,
                          self._views(group) if views is None else views, unseen, f" ({why})")
        self._say("warning", group, line)

    def _told(self, group: Any, title: str, count: int, views: list[RankView], unseen: str,
              why: str = "") -> str:
        """The line of a look (``title``: stall or busy) with ``why`` after the summary, and
        where its evidence went: a new ``<title>-N`` folder of the run's."""
        parent = getattr(self.config, "run_dir", "") or getattr(self.config, "log_dir", "")
        node, nnodes = _part(group)
        unit = _unit(group)
        folder = evidence_folder(parent, title, node=node if nnodes > 1 else None,
                                 count=count, unit=unit)
        now = time.monotonic()
        line = summarize(views, now, title=title, unseen=unseen, unit=unit) + why
        try:
            write_evidence(folder, views, f"{line}; stacks: {folder}{os.sep}", now)
        except OSError as exc:
            return f"{line} (stacks not kept: {exc.strerror})"
        return f"{line}; stacks: {folder}{os.sep}"

    def _say(self, word: str, group: Any, line: str) -> None:
        name = getattr(group, "name", "")
        text = f"{word}: {name + ': ' if name else ''}{line}"
        relay = getattr(group, "relay", None)
        if relay is not None:  # (a Ray actor's goes on to its driver)
            relay.say(text)
            return
        sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def _stalled(self, group: Any, views: list[RankView], unseen: str) -> None:
        """No rank moves or works: the line that names the culprit, the evidence, and (by
        default) the end of the workers."""
        self.stalls += 1
        line = self._told(group, "stall", self.stalls, views, unseen)
        self.summary = line
        self._say("warning" if self.wait_on else "error", group, line)
        if not self.wait_on:
            group.abort(line)
