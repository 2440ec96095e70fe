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
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import threading
import time
from typing import Any

from distrun._diagnose.watcher import COLLECT

__all__ = ["KEY_PREFIX", "serve_exchange"]

KEY_PREFIX = "distrun/stall"
#: of the seconds a rank collects, those left for the other nodes to read what it collected
READ = 3.0


def serve_exchange(folder: str, rank: int, environ: dict[str, str] | None = None) -> bool:
    """In a rank of a multi-node run: answer its watcher's requests (see module doc)."""
    env = os.environ if environ is None else environ
    if int(env.get("GROUP_WORLD_SIZE", "1") or 1) < 2 or not hasattr(os, "mkfifo"):
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
    pending = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:
            return
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            with contextlib.suppress(Exception):  # the diagnosis is lost, never the run
                _answer(line.decode().strip(), folder, env)


def _answer(key: str, folder: str, env: dict[str, str]) -> None:
    """Publish this node's report under ``key``, collect the others', write them back."""
    import torch.distributed as dist

    nnodes = int(env.get("GROUP_WORLD_SIZE", "1"))
    node = int(env.get("GROUP_RANK", "0"))
    with open(os.path.join(folder, f"node-{key}.json")) as fh:
        mine = fh.read()
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=COLLECT))
    # what every node of this attempt shares (a static run's launchers have each their own
    # run id): the store is the run's own, the restart and the rendezvous round its attempt
    prefix = f"{KEY_PREFIX}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/" \
             f"{env.get('DISTRUN_RDZV_GENERATION', '')}/{key}"
    store.set(f"{prefix}/{node}", mine)
    got: dict[int, Any] = {node: json.loads(mine)}
    started = time.monotonic()
    while len(got) < nnodes and time.monotonic() < started + COLLECT - READ:
        for other in range(nnodes):
            name = f"{prefix}/{other}"
            if other not in got and store.check([name]):
                got[other] = json.loads(store.get(name))
        if len(got) < nnodes:
            time.sleep(0.1)
    # every node that published reads the others' before any watcher goes on and ends its
    # workers (the store may end with them)
    store.set(f"{prefix}/read/{node}", "1")
    marks = [f"{prefix}/read/{other}" for other in got]
    while not store.check(marks) and time.monotonic() < started + COLLECT:
        time.sleep(0.05)
    out = os.path.join(folder, f"reports-{key}.json")
    with open(out + ".tmp", "w") as fh:
        json.dump({str(k): v for k, v in got.items()}, fh)
    os.replace(out + ".tmp", out)
