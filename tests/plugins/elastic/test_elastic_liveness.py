"""A lost node is found by the agents' heartbeats, not by waiting out a collective.

Two launchers on 127.0.0.1 act as two nodes (``--nnodes 1:2``, c10d). Freezing one node's
whole process group with SIGSTOP is, for its peer, exactly a partition: no process dies, no
socket closes, its collectives just stop answering. Every test runs with ``--timeout 300``, so
a detection that were only a shorter collective timeout would make them time out instead.
The multi-host versions (a real link cut between network namespaces) are in
tests/integration/test_multihost_faults.py.
"""

from __future__ import annotations

import os
import signal

import pytest
from elastic_helpers import TASK, TRAIN, Launcher, plugin_env, records, steps_trained

from distrun._launch.lifeline import pid_alive
from distrun.testing import free_port

#: one worker per launcher, the reference's global batch, and a collective timeout far above
#: the heartbeat timeout
ONE_EACH = [a if a != "2" else "1" for a in TRAIN]
ONE_EACH[ONE_EACH.index("--timeout") + 1] = "300"
HEARTBEAT = "4"


def _pair(tmp_path, rec, conf: str = "", **env):
    port = free_port()
    conf = ",".join(filter(None, ["is_host={}", conf]))
    common = ["--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "pair",
              "--max-restarts", "2", "--ckpt-every-n-steps", "2", "--heartbeat-timeout",
              HEARTBEAT, *ONE_EACH, TASK]
    # "a" hosts the rendezvous store; "b" is the other node
    a = Launcher(["--rdzv-conf", conf.format("true"), *common],
                 plugin_env(rec, EL_NODE="a", EL_STEP_SLEEP="0.3", **env), tmp_path, "a")
    b = Launcher(["--rdzv-conf", conf.format("false"), *common],
                 plugin_env(rec, EL_NODE="b", EL_STEP_SLEEP="0.3", **env), tmp_path, "b")
    return a, b


def _freeze(launcher: Launcher, rec) -> None:
    """SIGSTOP the launcher's session and its workers (they run in sessions of their own)."""
    os.killpg(launcher.proc.pid, signal.SIGSTOP)
    for event in records(rec, "events.jsonl"):
        if event["node"] == launcher.log.stem:
            try:
                os.kill(event["pid"], signal.SIGSTOP)
            except ProcessLookupError:
                pass


def _kill(launcher: Launcher, rec) -> None:
    launcher.kill_all()
    for event in records(rec, "events.jsonl"):
        if event["node"] == launcher.log.stem:
            for sig in (signal.SIGKILL, signal.SIGCONT):
                try:
                    os.kill(event["pid"], sig)
                except ProcessLookupError:
                    pass
    try:
        os.killpg(launcher.proc.pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
    launcher.wait(timeout=30)


@pytest.mark.slow
def test_a_frozen_node_is_named_in_seconds_and_the_survivor_reforms(tmp_path, reference):
    rec = tmp_path / "rec"
    a, b = _pair(tmp_path, rec)
    ckpts = tmp_path / "runs" / "pair" / "checkpoints"
    try:
        a.wait_until(lambda: (ckpts / "step-4").is_dir(), "the checkpoint of step 4")
        _freeze(b, rec)
        code = a.wait(timeout=240)
    finally:
        a.kill_all()
        _kill(b, rec)
    out = a.output()
    assert code == 0, out
    assert "lost host" in out and "(node 1): no heartbeat for" in out, out
    assert "re-formed at 1 rank on 1 host" in out, out
    assert "Traceback" not in out and "uneven inputs" not in out, out
    alone = [e for e in records(rec, "events.jsonl") if e["world"] == 1]
    assert alone and alone[0]["node"] == "a" and alone[0]["resumed_from"], out
    # the final history consumed every sample of the reference run once, in its steps
    trained, want = steps_trained(rec), steps_trained(reference)
    assert sorted(trained) == sorted(want)
    assert all(sorted(trained[s]) == sorted(want[s]) for s in want)


@pytest.mark.slow
@pytest.mark.parametrize("conf", ["", "keep_alive_interval=60"], ids=["heartbeat", "in-store-call"])
def test_the_node_cut_off_from_the_store_stops_with_one_line_and_a_retry_code(tmp_path, conf):
    """The rendezvous host frozen: the other node cannot reach the store (torch's c10d store
    lives in that host's agent) and ends with one line naming the endpoint, exit 143.

    ``in-store-call``: with torch's rendezvous keep-alive far apart, the agent's main thread is
    the one that meets the frozen store: its TCPStore.get gives up waiting after read_timeout,
    then waits for the answer to its cancel with no timeout, and torch retries that read when a
    signal interrupts it (before the fix the node never stopped)."""
    rec = tmp_path / "rec"
    a, b = _pair(tmp_path, rec, conf=conf)
    ckpts = tmp_path / "runs" / "pair" / "checkpoints"
    try:
        b.wait_until(lambda: (ckpts / "step-4").is_dir(), "the checkpoint of step 4")
        _freeze(a, rec)
        code = b.wait(timeout=120)
    finally:
        _kill(a, rec)
        b.kill_all()
    out = b.output()
    assert code == 143, out
    lines = [line for line in out.splitlines() if "cannot reach the rendezvous store" in line]
    assert len(lines) == 1 and "127.0.0.1:" in lines[0] and "exit 143" in lines[0], out
    assert "Traceback" not in out, out
    # nothing of node b is left running
    assert not [e for e in records(rec, "events.jsonl") if e["node"] == "b"
                and pid_alive(e["pid"])]
