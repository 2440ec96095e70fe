"""Elastic runs on real network hosts (distrun.testing.hosts) losing a host, a link, or the
rendezvous host, and hosts joining late.

Each host runs ``distrun run --nnodes MIN:MAX --rdzv-endpoint 198.18.0.1:P --rdzv-id J`` as on
a cluster; the run folder is on storage every host sees. The task is the elastic tests' (a
tiny regression whose batches carry their sample indices, recorded per step by the
``elastic_faults`` test plugin), so a test can check that over the steps of the final history
every sample of the reference run was consumed exactly once, in the same step, whatever the
world size became. Every run keeps ``--timeout 300``: what finds a lost host is the agents'
heartbeat (``--heartbeat-timeout``, 5 s here), never a collective timing out.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distrun.testing import run_cli

pytestmark = pytest.mark.multihost

ROOT = Path(__file__).resolve().parents[2]
ELASTIC_TESTS = ROOT / "tests" / "plugins" / "elastic"
sys.path.insert(0, str(ELASTIC_TESTS))
from elastic_helpers import TASK, plugin_env, records, steps_trained  # noqa: E402

#: one global batch of 16 samples, 36 steps over 3 epochs of 256 samples; 0.3 s a step
TRAIN = ["--strategy", "gradsum", "--batch-size", "16", "--max-epochs", "3", "--max-steps", "36",
         "--log-every-n-steps", "4", "--no-summary", "--timeout", "300",
         "--ckpt-every-n-steps", "2"]
HEARTBEAT = "5"
ENDPOINT = "198.18.0.1:29400"


def _env(rec: Path, node: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_", "PET_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                         "GLOO_SOCKET_IFNAME")}
    env.update(plugin_env(rec, EL_NODE=node, EL_STEP_SLEEP="0.3", **extra))
    env["PYTHONPATH"] = os.pathsep.join([str(ELASTIC_TESTS), str(ROOT),
                                         os.environ.get("PYTHONPATH", "")])
    return env


class Node:
    """``distrun run`` on one host of the testbed, its output in ``<cwd>/<name>.log``."""

    def __init__(self, host, cwd: Path, rec: Path, args: list[str], name: str,
                 **extra: str) -> None:
        self.host, self.log = host, cwd / f"{name}.log"
        with open(self.log, "w") as fh:
            self.proc = host.popen([sys.executable, "-m", "distrun", "run", *args, TASK],
                                   env=_env(rec, host.name, **extra), cwd=cwd, stdout=fh,
                                   stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float = 240) -> int:
        return self.proc.wait(timeout=timeout)


def _elastic(nodes: str, nproc: int, *extra: str) -> list[str]:
    return ["--nnodes", nodes, "--nproc-per-node", str(nproc), "--rdzv-endpoint", ENDPOINT,
            "--rdzv-id", "job", "--max-restarts", "3", "--heartbeat-timeout", HEARTBEAT,
            *TRAIN, *extra]


def _wait_for(predicate, what: str, nodes: list[Node], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        for node in nodes:
            if node.proc.poll() is not None:
                raise AssertionError(f"{node.host.name} ended before {what}:\n{node.output()}")
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.2)


def _reference(tmp_path: Path) -> Path:
    """The uninterrupted run on one host, one process: its record folder."""
    rec = tmp_path / "ref-rec"
    result = run_cli("run", *TRAIN, "--name", "ref", TASK, cwd=tmp_path,
                     env=_env(rec, "ref"), timeout=240)
    assert result.returncode == 0, result
    return rec


def _same_samples(rec: Path, reference: Path) -> None:
    """Over the final history, every step consumed the reference step's samples, once."""
    trained, want = steps_trained(rec), steps_trained(reference)
    assert sorted(trained) == sorted(want) == list(range(1, 37))
    for step in want:
        assert sorted(trained[step]) == sorted(want[step]), f"step {step}"
        assert len(set(trained[step])) == len(trained[step]), f"step {step} repeats a sample"


def _fit(rec: Path) -> float:
    """Mean squared error of the run's final weights over all 256 samples, dropout off."""
    import torch
    from elastic_helpers import final_weights
    from elastic_task import ElasticTask

    task = ElasticTask()
    model = task.configure_model()
    model.load_state_dict(final_weights(rec))
    model.eval()
    x, y, _ = task.data.tensors
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(x), y).item()


def test_a_killed_host_is_left_behind_and_rejoins_without_spending_a_restart(distrun_hosts,
                                                                            tmp_path):
    """kill -9 of every process of host 1 (3 ranks of 4): host 0 (1 rank) re-forms alone from
    the newest checkpoint with the global data cursor; host 1 started again joins back."""
    bed = distrun_hosts(2)
    reference = _reference(tmp_path)
    rec = tmp_path / "rec"
    ckpts = tmp_path / "runs" / "job" / "checkpoints"
    first = Node(bed[0], tmp_path, rec, _elastic("1:2", 1), "host0")
    second = Node(bed[1], tmp_path, rec, _elastic("1:2", 3), "host1")
    _wait_for(lambda: any(e["world"] == 4 for e in records(rec, "events.jsonl")),
              "the 4-rank round", [first, second])
    _wait_for(lambda: (ckpts / "step-6").is_dir(), "the checkpoint of step 6", [first, second])
    bed[1].kill_all()
    second.wait(timeout=30)
    _wait_for(lambda: any(e["world"] == 1 and e["attempt"] >= 1
                          for e in records(rec, "events.jsonl")), "host 0 alone", [first])
    back = Node(bed[1], tmp_path, rec, _elastic("1:2", 3), "host1-again")
    assert first.wait() == 0, first.output()
    assert back.wait() == 0, back.output()
    out = first.output()
    assert "Traceback" not in out, out
    assert "lost the connection to another rank" in out, out  # the worker's one line
    assert "re-formed at 1 rank on 1 host" in out and "re-formed at 4 ranks on 2 hosts" in out
    assert "(restart 1 of 3)" in out and "(restart 2 of 3)" not in out, out  # scale-up is free
    alone = [e for e in records(rec, "events.jsonl") if e["world"] == 1]
    assert alone[0]["node"] == "host0" and alone[0]["resumed_from"]
    assert alone[0]["epoch"] * 256 + alone[0]["cursor"] == alone[0]["step"] * 16
    _same_samples(rec, reference)
    # Same samples in the same steps; only the dropout draws differ with the world size, so
    # the fit over the whole set (not one noisy 16-sample batch) matches the reference's.
    fit, want = _fit(rec), _fit(reference)
    assert abs(fit - want) <= 0.05 * want, (fit, want)


#: the strategy's plugin, where the test plugins do not bring it
_STRATEGY_PLUGIN = {"gradsum": {}, "fsdp": {
    "DISTRUN_PLUGINS": "distrun_elastic.plugin,distrun_safetensors.plugin,elastic_faults,"
                       "distrun_fsdp.plugin"}}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["gradsum", "fsdp"])
def test_a_lost_host_re_forms_from_the_memory_of_the_host_left(distrun_hosts, tmp_path,
                                                              strategy):
    """Memory checkpoints every step, disk every 10: kill -9 of every process of host 1 (3
    ranks of 4) past step 12, and the run's checkpoint folder (with its step 10) moved away
    before host 0 re-forms, so no disk read is possible: host 0 resumes alone from memory at
    the newest step it committed, with the weights the run had at the end of that step bit
    for bit, and the final history consumes the reference's samples. Data parallel
    (``gradsum``), host 0's memory holds the whole state; FSDP over the 4 ranks, it holds its
    rank's shards and the copy host 1 sent of its 3 ranks' (the peer replica)."""
    bed = distrun_hosts(2)
    reference = _reference(tmp_path)
    rec = tmp_path / "rec"
    ckpts = tmp_path / "runs" / "job" / "checkpoints"
    memory = ["--ckpt-every-n-steps", "10", "--ckpt-memory-every-n-steps", "1",
              "--strategy", strategy]
    env = {"EL_DIGEST": "1", **_STRATEGY_PLUGIN[strategy]}
    first = Node(bed[0], tmp_path, rec, _elastic("1:2", 1, *memory), "host0", **env)
    second = Node(bed[1], tmp_path, rec, _elastic("1:2", 3, *memory), "host1", **env)
    digests = rec / "digests.jsonl"
    _wait_for(lambda: any(d["step"] >= 12 for d in records(rec, "digests.jsonl"))
              if digests.exists() else False, "step 12", [first, second])
    bed[1].kill_all()
    second.wait(timeout=30)
    # host 1's memory went with it on a real cluster; here the hosts share this machine's
    # /dev/shm, and kill_all ended its launcher's keeper too: its folder goes now
    from distrun_safetensors.memory_tier import sweep_orphans

    sweep_orphans("/dev/shm")
    aside = tmp_path / "runs" / "job" / "checkpoints-aside"
    ckpts.rename(aside)  # its step 10 can no longer be read
    _wait_for(lambda: any(e["world"] == 1 for e in records(rec, "events.jsonl")),
              "host 0 alone", [first])
    assert first.wait() == 0, first.output()
    out = first.output()
    assert "Traceback" not in out and "memory tier off" not in out, out
    alone = [e for e in records(rec, "events.jsonl") if e["world"] == 1][0]
    assert alone["resumed_from"].startswith("/dev/shm/distrun-ckpt-memory-"), alone
    before = [d for d in records(rec, "digests.jsonl") if d["attempt"] == 0]
    last = max(d["step"] for d in before if d["node"] == "host0")
    assert alone["step"] >= last - 1, (alone, last)  # at most one finished step redone
    want = {d["digest"] for d in before if d["step"] == alone["step"]}
    assert want == {alone["digest"]}, (alone, want)
    assert (aside / "step-10").is_dir() and alone["step"] > 10, alone
    assert not os.path.exists(os.path.dirname(alone["resumed_from"]))
    _same_samples(rec, reference)
    fit, want_fit = _fit(rec), _fit(reference)
    assert abs(fit - want_fit) <= 0.05 * want_fit, (fit, want_fit)


def test_a_cut_link_is_named_in_seconds_and_the_cut_host_stops_with_one_line(distrun_hosts,
                                                                             tmp_path):
    """Host 1's cable pulled: nothing resets, every collective would wait out --timeout 300.
    Host 0 names host1 after the heartbeat timeout and re-forms; host 1, cut off from the
    store, stops its workers and exits 143 (requeue) with one line."""
    bed = distrun_hosts(2)
    reference = _reference(tmp_path)
    rec = tmp_path / "rec"
    ckpts = tmp_path / "runs" / "job" / "checkpoints"
    first = Node(bed[0], tmp_path, rec, _elastic("1:2", 1), "host0")
    second = Node(bed[1], tmp_path, rec, _elastic("1:2", 1), "host1")
    _wait_for(lambda: (ckpts / "step-6").is_dir(), "the checkpoint of step 6", [first, second])
    bed[1].cut()
    cut_at = time.monotonic()
    assert second.wait(timeout=120) == 143, second.output()
    code = first.wait()
    bed[1].restore()
    out, cut_out = first.output(), second.output()
    assert code == 0, out
    said = [line for line in out.splitlines() if line.startswith("distrun: lost host host1")]
    assert len(said) == 1 and "no heartbeat for" in said[0], out
    assert "uneven inputs" not in out and "Traceback" not in out, out
    assert "re-formed at 1 rank on 1 host" in out, out
    stopped = [line for line in cut_out.splitlines() if "cannot reach the rendezvous" in line]
    assert len(stopped) == 1 and ENDPOINT in stopped[0] and "exit 143" in stopped[0], cut_out
    assert not bed[1].pids(), "host 1 kept processes after it stopped"
    assert time.monotonic() - cut_at < 200  # far below the 300 s collective timeout
    _same_samples(rec, reference)


@pytest.mark.slow
def test_hosts_start_in_any_order_and_a_late_one_joins(distrun_hosts, tmp_path):
    """``--nnodes 2:3``: host 0 (it serves the rendezvous endpoint) waits alone, host 1 makes
    the minimum and the run starts at 2 ranks; host 2 joins late and the run re-forms at 3."""
    bed = distrun_hosts(3)
    rec = tmp_path / "rec"
    ckpts = tmp_path / "runs" / "job" / "checkpoints"
    args = _elastic("2:3", 1, "--batch-size", "24")  # a global batch 2 and 3 ranks divide
    nodes = [Node(bed[0], tmp_path, rec, args, "host0")]
    time.sleep(2)
    nodes.append(Node(bed[1], tmp_path, rec, args, "host1"))
    _wait_for(lambda: (ckpts / "step-4").is_dir(), "the checkpoint of step 4", nodes)
    nodes.append(Node(bed[2], tmp_path, rec, args, "host2"))
    codes = [node.wait() for node in nodes]
    assert codes == [0, 0, 0], "\n=====\n".join(n.output() for n in nodes)
    out = nodes[0].output()
    assert "re-formed at 3 ranks on 3 hosts" in out, out
    worlds = [e["world"] for e in records(rec, "events.jsonl") if e["rank"] == 0]
    assert worlds[0] == 2 and worlds[-1] == 3, worlds
    assert "restart 1 of" not in out, out  # a join spends no restart


@pytest.mark.slow
def test_losing_the_rendezvous_host_ends_the_others_with_one_line_and_a_retry_code(
        distrun_hosts, tmp_path):
    """torch's c10d rendezvous keeps its store in the agent at --rdzv-endpoint: with that host
    gone there is nowhere to re-form. The others stop in one line naming the endpoint, exit 143
    (what a scheduler requeues), leaving nothing running."""
    bed = distrun_hosts(2)
    rec = tmp_path / "rec"
    ckpts = tmp_path / "runs" / "job" / "checkpoints"
    first = Node(bed[0], tmp_path, rec, _elastic("1:2", 1), "host0")
    second = Node(bed[1], tmp_path, rec, _elastic("1:2", 1), "host1")
    _wait_for(lambda: (ckpts / "step-4").is_dir(), "the checkpoint of step 4", [first, second])
    bed[0].kill_all()
    first.wait(timeout=30)
    assert second.wait(timeout=120) == 143, second.output()
    out = second.output()
    assert "Traceback" not in out, out
    stopped = [line for line in out.splitlines() if "cannot reach the rendezvous" in line]
    assert len(stopped) == 1 and ENDPOINT in stopped[0], out
    assert not bed[1].pids()
