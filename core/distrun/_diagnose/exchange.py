"""Across nodes: each node's stall report, shared through the run's own store.

Every node's stall watcher sees its own ranks only; a rank that holds up a multi-node run sits
on one node, and the user watches another. The launchers share no channel (they are torch-free
and do not connect to the store), but their ranks do: each rank of a multi-node run keeps a
thread that sleeps on a FIFO in its positions folder (``rank<N>.ask``). A watcher that found
a stall writes its node's report (:func:`distrun._diagnose.summary.report_of`) beside it and
asks one of its ranks through the FIFO; that rank's thread puts the report in the store under
the stall's key, collects the other nodes' for a few seconds, and writes them all back
(``reports-<key>.json``) for the watcher, which then names the culprit across the nodes.

A rank that waits in a collective releases the GIL, so its thread runs; a stopped rank or one
that holds the GIL in C cannot answer, and the watcher asks the next. The store is where the
ranks rendezvoused (rank 0's, or the elastic agent's): while it answers, the nodes' reports
meet there. It may not answer for long once a watcher goes on: ``--on-stall stop`` ends that
node's workers, rank 0 and its store among them. So no rank hands its watcher the reports
before every node that published has read the others' (each marks it in the store), within
the time a watcher waits.

A request asks the other nodes too (``distrun stacks`` typed on one node, and a watcher's
stall, which another node's watcher may see later than the others wait): the asking node's
ranks post it in the store (a counter and the key) and each rank of every node looks there
every :data:`LOOK` seconds while its FIFO is quiet (one small request to the store); the first
rank of a node to claim a request reads its node's positions and stacks itself
(:func:`distrun._diagnose.watcher.node_views`) and publishes them under the request's key.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import select
import sys
import threading
import time
from typing import Any

from distrun._diagnose.position import PART_ENV
from distrun._diagnose.watcher import COLLECT

__all__ = ["KEY_PREFIX", "part_of", "serve_exchange"]

KEY_PREFIX = "distrun/stall"
#: of the seconds a rank collects, those left for the other nodes to read what it collected
READ = 3.0
#: seconds between a rank's looks in the store for another node's ``distrun stacks``
LOOK = 2.0


def part_of(env: dict[str, str] | Any) -> tuple[int, int]:
    """(this rank's group, the run's groups): the launcher's :data:`PART_ENV` (a group is a
    node, or one rank where a launcher starts each rank), else torchrun's node and nodes."""
    index, _, count = str(env.get(PART_ENV, "")).partition("/")
    if index.isdigit() and count.isdigit():
        return int(index), int(count)
    return int(env.get("GROUP_RANK", "0") or 0), int(env.get("GROUP_WORLD_SIZE", "1") or 1)


def serve_exchange(folder: str, rank: int, environ: dict[str, str] | None = None) -> bool:
    """In a rank of a run started in several groups (nodes, or srun's tasks): answer its
    watcher's requests (see module doc)."""
    env = os.environ if environ is None else environ
    if part_of(env)[1] < 2 or not hasattr(os, "mkfifo"):
        return False
    path = os.path.join(folder, f"rank{rank}.ask")
    try:
        os.mkfifo(path, 0o600)
        fd = os.open(path, os.O_RDWR)  # (read-write: the open does not wait for a writer)
    except OSError:
        return False
    threading.Thread(target=_serve, args=(fd, folder, dict(env)), daemon=True,
                     name="distrun-stall-exchange").start()
    return True


def _serve(fd: int, folder: str, env: dict[str, str]) -> None:
    asks = _Asks(folder, env)
    pending = b""
    while True:
        try:
            ready, _, _ = select.select([fd], [], [], LOOK)
            if not ready:
                asks.look()
                continue
            chunk = os.read(fd, 4096)
        except OSError:
            return
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            key = line.decode().strip()
            with contextlib.suppress(Exception):  # the diagnosis is lost, never the run
                _answer(key, folder, env, asks.post)


def _prefix(env: dict[str, str]) -> str:
    # what every node of this attempt shares (a static run's launchers have each their own
    # run id): the store is the run's own, the restart and the rendezvous round its attempt
    return f"{KEY_PREFIX}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/" \
           f"{env.get('DISTRUN_RDZV_GENERATION', '')}"


def _store(env: dict[str, str], timeout: float) -> Any:
    import torch.distributed as dist

    return dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=timeout))


class _Asks:
    """The requests of another node (its ``distrun stacks``, its watcher's stall):
    ``<prefix>/asks`` counts them, ``<prefix>/asks/<n>`` holds the n-th's origin node and
    key."""

    def __init__(self, folder: str, env: dict[str, str]) -> None:
        self.folder, self.env = folder, env
        self.node = part_of(env)[0]
        self.key = f"{_prefix(env)}/asks"
        self.store: Any = None
        self.seen = 0  # requests answered or passed over (the prefix is this attempt's)
        self.retry_at = 0.0

    def _client(self) -> Any:
        # not before the rank's main thread joined its process group: torch imported in
        # this thread while the main thread imports it leaves half a module there
        dist = sys.modules.get("torch.distributed")
        try:
            joined = dist is not None and dist.is_initialized()
        except AttributeError:
            joined = False
        if joined and self.store is None and time.monotonic() >= self.retry_at:
            try:
                self.store = _store(self.env, 2 * LOOK)
            except Exception:  # not up yet, slow, or gone: look again at the next look
                self.retry_at = time.monotonic() + LOOK
        return self.store

    def post(self, store: Any, key: str) -> None:
        """In a rank of the asking node: ask the other nodes (once, whichever of the node's
        ranks comes first)."""
        if store.add(f"{self.key}/{key}/posted", 1) == 1:
            n = store.add(self.key, 1)
            store.set(f"{self.key}/{n}", f"{self.node} {key}")

    def look(self) -> None:
        """Answer the requests posted since the last look, for this node."""
        store = self._client()
        if store is None:
            return
        try:
            count = store.add(self.key, 0)
            while self.seen < count:
                origin, key = store.get(f"{self.key}/{self.seen + 1}").decode().split(" ", 1)
                self.seen += 1
                # (an asker that stopped collecting marked it read: too late to answer)
                if int(origin) != self.node and \
                        not store.check([f"{_prefix(self.env)}/{key}/read/{origin}"]) and \
                        store.add(f"{self.key}/{key}/node{self.node}", 1) == 1:
                    self._report(key)
        except Exception:  # the store is gone (the run ends) or slow: never the run; a
            self.store = None  # request is looked at again with a new client
            self.retry_at = time.monotonic() + LOOK

    def _report(self, key: str) -> None:
        from distrun._diagnose.summary import report_of
        from distrun._diagnose.watcher import node_views

        views = node_views(self.folder, look_busy=True)
        with open(os.path.join(self.folder, f"node-{key}.json"), "w") as fh:
            json.dump(report_of(views, time.monotonic()), fh)
        _answer(key, self.folder, self.env, collect=False)


def _answer(key: str, folder: str, env: dict[str, str], post: Any = None,
            collect: bool = True) -> None:
    """Publish this node's report under ``key``, collect the others', write them back.
    ``post``: also ask the other nodes; ``collect=False``: publish only (the answer to
    another node's request)."""
    node, nnodes = part_of(env)
    with open(os.path.join(folder, f"node-{key}.json")) as fh:
        mine = fh.read()
    store = _store(env, COLLECT)
    prefix = f"{_prefix(env)}/{key}"
    store.set(f"{prefix}/{node}", mine)
    if post is not None:
        post(store, key)
    if not collect:
        store.set(f"{prefix}/read/{node}", "1")
        return
    got: dict[int, Any] = {node: json.loads(mine)}
    started = time.monotonic()
    try:
        while len(got) < nnodes and time.monotonic() < started + COLLECT - READ:
            for other in range(nnodes):
                name = f"{prefix}/{other}"
                if other not in got and store.check([name]):
                    got[other] = json.loads(store.get(name))
            if len(got) < nnodes:
                time.sleep(0.1)
        # every node that published reads the others' before any watcher goes on and ends
        # its workers (the store may end with them)
        store.set(f"{prefix}/read/{node}", "1")
        marks = [f"{prefix}/read/{other}" for other in got]
        while not store.check(marks) and time.monotonic() < started + COLLECT:
            time.sleep(0.05)
    except Exception:  # the store ended: the node holding it went on once all had read, or
        pass  # it is gone; what was collected is handed over either way
    out = os.path.join(folder, f"reports-{key}.json")
    with open(out + ".tmp", "w") as fh:
        json.dump({str(k): v for k, v in got.items()}, fh)
    os.replace(out + ".tmp", out)
