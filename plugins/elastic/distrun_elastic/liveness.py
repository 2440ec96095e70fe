"""Heartbeats between the agents of one rendezvous round, so a lost host is named in seconds.

torch's agent notices a lost node only through its own workers: a peer that died takes its
sockets with it and the collectives fail at once, but a peer behind a cut link (or a frozen
host) leaves every collective waiting for the whole collective timeout (``--timeout``, 300 s by
default), after which the error reads like a slow or uneven rank. Each agent here runs a
thread that, every ``interval`` seconds, bumps its own counter in the round's store and reads
the counters of the other nodes; the agent's monitor loop then asks :meth:`Liveness.lost` and
:meth:`Liveness.cut_off`, which only compare clocks:

- a peer whose counter has not moved for ``timeout`` seconds is lost (its agent is dead, frozen
  or unreachable): the survivors stop their workers and re-form without it;
- this node is cut off when its store calls have failed for ``timeout`` seconds: the store
  lives in the agent at ``--rdzv-endpoint``, so either that host is down or this one is
  partitioned; either way this node cannot take part, and it stops. That is told from this
  thread (``on_cut_off``), since the agent's main thread may itself be stuck in a store call:
  torch's rendezvous calls retry while holding a lock that its keep-alive thread holds too.
  A store call to a frozen or unreachable host may also never return (torch's store client
  puts no timeout on ``add`` or ``check``): a call still waiting counts as failing since it
  began.

Counters, not timestamps: hosts' clocks need not agree, each agent times the counters it reads
with its own monotonic clock. The thread talks to the store over its own connection (a clone):
torch's store client serialises its calls, and one waiting on an unreachable store would hold
up the agent's other calls (its keep-alive and its own checks).

The keys live under the round's prefix (``torch.rendezvous.<run id>.<round>``), so a new round
starts from clean counters. Every node reads every other node's counter in one ``multi_get``: one
round trip per node per interval (the store still serves nodes^2 small values an interval:
benchmarks/control_plane.py measures it; past a few hundred nodes, each node would watch a few
ring neighbours instead, any loss still being seen by its neighbours, whose workers' failure then
reaches everyone).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

__all__ = ["LostPeer", "Liveness", "publish_generation"]

_ALIVE = "distrun.alive.{}"
_HOST = "distrun.host.{}"
_GENERATION = "distrun.generation"


@dataclass(frozen=True)
class LostPeer:
    """A node of this round whose heartbeat stopped."""

    group_rank: int
    hostname: str
    silent_for: float


def publish_generation(store: Any, run_id: str, group_rank: int) -> int:
    """A number that grows with every rendezvous round of the run, the same on every node.

    Node 0 of the round draws it from a counter in the rendezvous store (outside the round's
    prefix, so it survives rounds) and publishes it under the round's prefix; the others wait
    for it. Checkpoint commits carry it, so a node left behind in an old round cannot move
    ``latest`` over a newer round's checkpoints.
    """
    if group_rank == 0:
        base = getattr(store, "underlying_store", store)
        value = int(base.add(f"distrun.generation.{run_id}", 1))
        store.set(_GENERATION, str(value))
        return value
    return int(store.get(_GENERATION))


class Liveness:
    """This node's heartbeat and its view of every other node's, for one rendezvous round."""

    def __init__(self, store: Any, group_rank: int, group_world_size: int, *,
                 interval: float, timeout: float,
                 on_cut_off: Callable[[float], None] | None = None) -> None:
        self.group_rank = group_rank
        self.on_cut_off = on_cut_off
        self.interval = interval
        self.timeout = timeout
        self._peers = [r for r in range(group_world_size) if r != group_rank]
        self._keys = [_ALIVE.format(r) for r in self._peers]
        self._store = store.clone()  # its own connection: see the module docstring
        self._store.set_timeout(timedelta(seconds=max(1.0, min(interval * 2, timeout))))
        self._published = False
        now = time.monotonic()
        self._count = {r: -1 for r in self._peers}
        #: when each peer's counter last moved, by this node's clock
        self._seen = dict.fromkeys(self._peers, now)
        #: when this node last read every counter (peers are judged only against it: a node
        #: that was itself frozen or cut off has no evidence against anyone)
        self._polled = now
        #: when the current run of failed store calls began (None: the last one succeeded)
        self._failing_since: float | None = None
        #: when the poll now waiting on the store began (None: none is): a store call to a
        #: frozen or unreachable host may never return, it has no timeout of its own
        self._in_flight: float | None = None
        self._names: dict[int, str] = {}
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._beat, name="distrun-heartbeat",
                                          daemon=True),
                         threading.Thread(target=self._watch, name="distrun-liveness",
                                          daemon=True)]
        for thread in self._threads:
            thread.start()

    def _beat(self) -> None:
        while True:
            began = self._in_flight = time.monotonic()
            try:
                self._poll()
                self._failing_since = None
            except Exception:  # noqa: BLE001 - an unreachable store is what this measures
                if self._failing_since is None:
                    self._failing_since = began
            finally:
                self._in_flight = None
            if self._stop.wait(self.interval):
                return

    def _watch(self) -> None:
        """Tell ``on_cut_off`` once the store has been out of reach for the timeout. From
        this thread: the heartbeat may be stuck in a store call, and so may the agent's main
        thread (torch's rendezvous calls retry while holding a lock its keep-alive holds too)."""
        while not self._stop.wait(self.interval / 2):
            silent = self.cut_off()
            if silent is not None and self.on_cut_off is not None:
                self.on_cut_off(silent)
                return

    def _poll(self) -> None:
        store = self._store
        if not self._published:
            store.set(_HOST.format(self.group_rank), socket.gethostname())
            # every peer's counter exists from here on (adding 0 creates it, or leaves it), so
            # one multi_get reads them all: a round trip per poll, not one per peer
            for rank in self._peers:
                store.add(_ALIVE.format(rank), 0)
            self._published = True
        store.add(_ALIVE.format(self.group_rank), 1)
        counts = store.multi_get(self._keys) if self._keys else []
        now = time.monotonic()
        for rank, raw in zip(self._peers, counts):
            count = int(raw)
            if count != self._count[rank]:
                self._count[rank] = count
                self._seen[rank] = now
        unnamed = [r for r in self._peers if r not in self._names]
        if unnamed:
            keys = [_HOST.format(r) for r in unnamed]
            if store.check(keys):  # every name published: one read
                for rank, name in zip(unnamed, store.multi_get(keys)):
                    self._names[rank] = name.decode()
            else:
                for rank, key in zip(unnamed, keys):
                    if store.check([key]):
                        self._names[rank] = store.get(key).decode()
        self._polled = time.monotonic()

    def hostname(self, rank: int) -> str:
        """The host name node ``rank`` published (``node R`` until it has been read)."""
        return self._names.get(rank, f"node {rank}")

    def cut_off(self) -> float | None:
        """Seconds the store has been out of reach (calls failing, or one not answered),
        once that exceeds the timeout."""
        since = [t for t in (self._failing_since, self._in_flight) if t is not None]
        if not since:
            return None
        silent = time.monotonic() - min(since)
        return silent if silent > self.timeout else None

    def lost(self) -> list[LostPeer]:
        """The peers whose counter did not move over the last ``timeout`` seconds of polls."""
        polled = self._polled
        return [LostPeer(r, self.hostname(r), polled - seen) for r, seen in self._seen.items()
                if polled - seen > self.timeout]

    def stop(self) -> None:
        """Stop both threads (a heartbeat stuck in a store call is left behind: a daemon)."""
        self._stop.set()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=self.interval + 1.0)
