"""A node frozen mid-commit (SIGSTOP: a partition, as far as its peers can tell) comes back after
the survivors re-formed without it and committed newer checkpoints: its commit is fenced, and
`latest` never goes back. Two launchers on 127.0.0.1 are the two nodes; the rendezvous store is
a process of its own, so either node can be the one frozen."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from elastic_helpers import TASK, TRAIN, Launcher, plugin_env, records

from distrun._launch.lifeline import pid_alive
from distrun.testing import free_port

STORE = """
import signal, sys
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False)
print("ready", flush=True)
signal.pause()
"""


def _latest(ckpts) -> tuple[str, int] | None:
    """(folder `latest` names, its manifest's generation), or None while there is none."""
    try:
        name = (ckpts / "latest").read_text().strip()
        manifest = json.loads((ckpts / name / "manifest.json").read_text())
    except (OSError, ValueError):  # not there yet, or pruned between the two reads
        return None
    return name, manifest["generation"]


class Watch(threading.Thread):
    """Every change of `latest` (and its generation) while the test runs."""

    def __init__(self, ckpts) -> None:
        super().__init__(daemon=True)
        self.ckpts, self.seen, self.stop = ckpts, [], threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            now = _latest(self.ckpts)
            if now is not None and (not self.seen or self.seen[-1] != now):
                self.seen.append(now)
            time.sleep(0.02)


def _step(latest: tuple[str, int] | None) -> int:
    return int(latest[0].split("-")[1]) if latest else 0


def _freeze(pids: list[int], sig: int) -> None:
    for pid in pids:  # each a process group: the launcher's, each worker's (torch's agent
        try:           # starts them in sessions of their own)
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_frozen_node_comes_back_fenced_and_latest_never_moves_back(tmp_path):
    rec = tmp_path / "rec"
    port = free_port()
    store = subprocess.Popen([sys.executable, "-c", STORE, str(port)], stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    train = list(TRAIN)
    train[train.index("--log-every-n-steps") + 1] = "2"
    train[train.index("--nproc-per-node") + 1] = "1"  # one worker per node
    common = ["--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "fence",
              "--rdzv-conf", "is_host=false", "--heartbeat-timeout", "4", "--max-restarts", "3",
              "--ckpt-every-n-steps", "6", "--ckpt-keep-last", "0", *train, TASK]
    nodes = {}
    ckpts = tmp_path / "runs" / "fence" / "checkpoints"
    watch = Watch(ckpts)
    try:
        assert store.stdout.readline().strip() == "ready"
        for name in ("a", "b"):
            nodes[name] = Launcher(common, plugin_env(rec, EL_NODE=name, EL_STEP_SLEEP="0.3",
                                                      EL_COMMIT_PAUSE="12"), tmp_path, name)
        watch.start()
        # Rank 0 of the 2-node round has written and synced step 12 and is about to commit it
        # (it committed step 6 and logged the metrics of steps 2 to 10).
        paused = rec / "paused.json"
        nodes["a"].wait_until(paused.exists, "the commit of step 12 on rank 0")
        held = json.loads(paused.read_text())
        frozen, survivor = nodes[held["node"]], nodes["b" if held["node"] == "a" else "a"]
        _freeze([frozen.proc.pid, held["pid"]], signal.SIGSTOP)
        rows_before = [int(float(r["step"])) for r in csv.DictReader(
            (tmp_path / "runs" / "fence" / "metrics.csv").open())]
        # The survivor loses its heartbeats, re-forms alone from step 6 and commits 12 and 18.
        survivor.wait_until(lambda: _step(_latest(ckpts)) >= 18,
                            "the survivors' checkpoint of step 18")
        newer = _latest(ckpts)[1]
        assert newer > held["generation"]
        # The frozen worker goes on first (its agent still frozen): its commit is fenced.
        (rec / "go").touch()
        _freeze([held["pid"]], signal.SIGCONT)
        deadline = time.monotonic() + 120
        while pid_alive(held["pid"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(held["pid"]), "the frozen worker did not finish its commit"
        assert _latest(ckpts)[1] == newer  # the survivors' (they go on committing meanwhile)
        step12 = json.loads((ckpts / "step-12" / "manifest.json").read_text())
        assert step12["generation"] == newer  # the survivors' step 12, not replaced
        assert not [p for p in ckpts.iterdir() if p.name.startswith(".tmp-step-12-")]
        _freeze([frozen.proc.pid], signal.SIGCONT)  # its agent rejoins; the run scales up
        codes = {name: node.wait(timeout=300) for name, node in nodes.items()}
    finally:
        watch.stop.set()
        for node in nodes.values():
            _freeze([node.proc.pid], signal.SIGCONT)
            node.kill_all()
        os.killpg(store.pid, signal.SIGKILL)
        store.wait(timeout=60)
    out = {name: node.output() for name, node in nodes.items()}
    assert codes == {"a": 0, "b": 0}, out
    line = re.compile(
        rf"^error: fenced: round {newer} has committed step (\d+); this node's round "
        rf"{held['generation']} is stale \(the run re-formed without it, or a newer run writes "
        rf"{re.escape(os.path.join('runs', 'fence', 'checkpoints'))}\); its checkpoint of step "
        r"12 was not committed$", re.M)
    fenced = line.findall(frozen.output())
    assert len(fenced) == 1 and int(fenced[0]) >= 18, frozen.output()
    gens = [g for _, g in watch.seen]
    assert gens == sorted(gens), watch.seen  # `latest` never went back to an older round
    assert watch.seen[-1][0] == "step-36"
    # metrics.csv: each step once, the rows the survivors rolled back said in their log
    rows = list(csv.DictReader((tmp_path / "runs" / "fence" / "metrics.csv").open()))
    kinds = [(r["step"], bool(r["loss"])) for r in rows]
    assert len(kinds) == len(set(kinds)), rows
    trained = [int(s) for s, train_row in kinds if train_row]
    # a row every 2 steps, and one more where the rejoining node's scale-up stopped the
    # workers between two (they save and log the step they stop at)
    assert trained == sorted(set(trained)) and set(range(2, 37, 2)) <= set(trained), trained
    assert trained[-1] == 36 and len(trained) <= 18 + 2, trained
    rolled = sorted(s for s in rows_before if s > 6)  # logged by the frozen node's rank 0
    assert rolled, rows_before
    which = f"step {rolled[0]}" if rolled[0] == rolled[-1] else f"steps {rolled[0]} to {rolled[-1]}"
    said = (f"metrics.csv: replacing {len(rolled)} row{'s' * (len(rolled) != 1)} of {which}: the "
            "run went back to step 6 (resumed from ")
    assert survivor.output().count(said) == 1, survivor.output()
    # the frozen node's agent started its workers again in a newer round (it rejoined the
    # survivors, or, had they finished meanwhile, found the run done)
    assert any(e["node"] == held["node"] and e["generation"] > newer
               for e in records(rec, "events.jsonl")), records(rec, "events.jsonl")
