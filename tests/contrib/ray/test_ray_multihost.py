"""`--launcher ray` across two hosts: a Ray head in one network namespace, a worker node in another.

The testbed (:mod:`distrun.testing.hosts`) gives each host its own address, name and hosts file;
``ray start --head --node-ip-address <host0>`` runs on host0, ``ray start --address
<host0>:PORT --node-ip-address <host1>`` on host1, and ``distrun run --launcher ray`` is started
on host0 as a user would. The run folder is on storage both hosts see. The task is a small
regression under ddp whose final weights are compared, bit for bit, with a one-host run of the
same global batch. Skips without Ray, without namespaces, or without ddp and safetensors.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install ray, or tox -e contrib-ray)")
pytest.importorskip("distrun_ray", reason="distrun-ray is not installed (tox -e contrib-ray)")

from distrun.testing.hosts import Testbed, unavailable  # noqa: E402

pytestmark = [
    pytest.mark.multihost,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("distrun_ddp") is None,
                       reason="needs the ddp strategy: pip install distrun-ddp"),
    pytest.mark.skipif(importlib.util.find_spec("distrun_safetensors") is None,
                       reason="needs a checkpoint plugin: pip install distrun-safetensors"),
]

TASK = (Path(__file__).with_name("regress_task.py").read_text() + """
import socket


class Record:
    \"\"\"Each rank notes its host; with HOLD_FILE set, the rank on host1 of the first attempt
    says so after step 3 and waits there (the test kills its host).\"\"\"

    @distrun.hookimpl
    def distrun_on_fit_start(self, run):
        self.start_step = run.progress.step
        if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            with open(os.path.join(os.environ["OUT_DIR"], f"first-rank{run.rank}"), "w") as fh:
                fh.write(f"{socket.gethostname()} {os.getpid()}")
        with open(os.path.join(os.environ["OUT_DIR"], f"host-of-rank{run.rank}"), "w") as fh:
            fh.write(f"{socket.gethostname()} {os.getpid()}")

    @distrun.hookimpl
    def distrun_on_step_end(self, run, step):
        hold = os.environ.get("HOLD_FILE")
        if hold and step == 3 and socket.gethostname() == "host1" \\
                and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            with open(hold + ".tmp", "w") as fh:
                fh.write(str(run.rank))
            os.replace(hold + ".tmp", hold)
            time.sleep(120)  # the test kills this host; waking up here is a failure
            sys.exit(99)

    @distrun.hookimpl
    def distrun_on_fit_end(self, run):
        if run.is_global_zero:
            weights = [p.detach().flatten().tolist() for p in run.unwrapped_model().parameters()]
            with open(os.path.join(os.environ["OUT_DIR"], "result.json"), "w") as fh:
                json.dump({"start_step": self.start_step, "step": run.progress.step,
                           "resumed_from": run.resumed_from, "weights": weights}, fh)


if __name__ == "__main__":
    distrun.Trainer(plugins=(Record(),)).fit(Regress())
""")

#: 2 ranks x 8 samples a step, 6 steps, a checkpoint every 2; --timeout 300 so a hang shows
COMMON = ["--strategy", "ddp", "--max-epochs", "10", "--batch-size", "8", "--max-steps", "6",
          "--ckpt-every-n-steps", "2", "--no-summary", "--timeout", "300"]


def _env(out: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_", "PET_",
                                "KUBERNETES_", "RAY_ADDRESS", "GLOO_", "TP_SOCKET"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", OUT_DIR=str(out), **extra)
    return env


def _result(out: Path) -> dict:
    return json.loads((out / "result.json").read_text())


def _ranks_at_the_hold(out: Path) -> list[str]:
    """'HOST PID' of each rank of the first attempt (written before the kill)."""
    return [(out / f"first-rank{r}").read_text() for r in range(2)]


def _hosts_of_ranks(out: Path) -> list[str]:
    return [(out / f"host-of-rank{r}").read_text().split()[0] for r in range(2)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The same 6 steps, 2 processes on one host, under the local launcher."""
    out = tmp_path_factory.mktemp("reference")
    (out / "task.py").write_text(TASK)
    ref = subprocess.run([sys.executable, "-m", "distrun", "run", "--nproc-per-node", "2",
                          *COMMON, "--name", "ref", "task.py"], cwd=out, env=_env(out),
                         capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    got = _result(out)
    assert (got["start_step"], got["step"], got["resumed_from"]) == (0, 6, None)
    return got


class TwoNodeRay:
    """A Ray head on host0 and a worker node on host1 of a testbed (2 logical CPUs each)."""

    def __init__(self) -> None:
        from distrun_ray.local_cluster import LocalRayCluster

        self.bed = Testbed.up(2)
        self.head = LocalRayCluster(num_cpus=2, start_timeout=180, node_ip=self.bed[0].address,
                                    wrap=self.bed[0].command)
        self.worker = LocalRayCluster(num_cpus=2, start_timeout=180,
                                      node_ip=self.bed[1].address, wrap=self.bed[1].command)
        self.address = ""

    def start(self) -> None:
        self.address = self.worker.join = self.head.start()
        self.worker.start()

    def ensure_worker(self) -> None:
        """Start host1's node again if a test killed it (a host that rebooted)."""
        if self.worker.proc is not None and self.worker.proc.poll() is not None:
            left = self.worker.stop()
            assert not left, f"the killed worker node left processes: {sorted(left)}"
            self.worker.start()

    def run(self, out: Path, *args: str, **env: str) -> subprocess.Popen:
        """``distrun run --launcher ray`` started on host0; its output in ``out/launcher.log``."""
        with open(out / "launcher.log", "w") as log:
            return self.bed[0].popen(
                [sys.executable, "-m", "distrun", "run", "--launcher", "ray", "--ray-address",
                 self.address, "--ray-num-workers", "2", "--ray-env", "OUT_DIR,HOLD_FILE", *args,
                 *COMMON, "task.py"],
                env=_env(out, **env), cwd=out, stdout=log, stderr=subprocess.STDOUT)

    def ranks_left(self) -> list[str]:
        """The run's worker processes (``task.py``) still alive on either host."""
        left = []
        for h in self.bed:
            for pid in h.pids():
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as fh:
                        argv = fh.read().split(b"\0")
                except OSError:  # ended meanwhile
                    continue
                if b"task.py" in argv:
                    left.append(f"{h.name}: {pid}")
        return left

    def stop(self) -> list[str]:
        """Stop both nodes and the testbed; what was still running on a host, if anything."""
        left = [f"{name}: {sorted(pids)}" for name, node in (("host1", self.worker),
                                                              ("host0", self.head))
                if (pids := node.stop())]
        left += [f"{h.name}: {h.pids()}" for h in self.bed if h.pids()]
        self.bed.down()
        return left


@pytest.fixture(scope="module")
def two_node_ray() -> Iterator[TwoNodeRay]:
    why = unavailable()
    if why:
        pytest.skip(f"multihost testbed unavailable: {why}")
    cluster = TwoNodeRay()
    try:
        cluster.start()
        yield cluster
    finally:
        left = cluster.stop()
        assert not left, f"processes left running: {left}"


def _finish(proc: subprocess.Popen, out: Path, timeout: float) -> str:
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return (out / "launcher.log").read_text(errors="replace")


def test_ranks_on_two_ray_nodes_train_as_one_host(two_node_ray, reference, tmp_path):
    two_node_ray.ensure_worker()
    (tmp_path / "task.py").write_text(TASK)
    started = time.monotonic()
    proc = two_node_ray.run(tmp_path, "--ray-placement", "STRICT_SPREAD", "--name", "spread")
    log = _finish(proc, tmp_path, timeout=240)
    took = time.monotonic() - started
    assert proc.returncode == 0, log
    assert sorted(_hosts_of_ranks(tmp_path)) == ["host0", "host1"], log
    got = _result(tmp_path)
    assert (got["start_step"], got["step"], got["resumed_from"]) == (0, 6, None)
    # CPU, fixed seed, the same global batch: the same weights as on one host
    assert got["weights"] == reference["weights"]
    print(f"two-node Ray run: {took:.1f} s")


def _kill_host1_at_step_3(two_node_ray: TwoNodeRay, out: Path, *args: str
                          ) -> tuple[subprocess.Popen, float]:
    """Start the run; once its rank on host1 holds after step 3, kill every process of host1
    (raylet, Ray workers, the rank). The launcher and the time of the kill."""
    hold = out / "held"
    proc = two_node_ray.run(out, *args, HOLD_FILE=str(hold))
    try:
        deadline = time.monotonic() + 180
        while not hold.exists():
            assert proc.poll() is None, (out / "launcher.log").read_text()
            assert time.monotonic() < deadline, "the rank on host1 never reached step 3"
            time.sleep(0.1)
        listening = {h.name: h.listening() for h in two_node_ray.bed}
        two_node_ray.bed[1].kill_all()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    (out / "listening.json").write_text(json.dumps(
        {name: [[ln.address, ln.port, ln.processes] for ln in lst]
         for name, lst in listening.items()}))
    return proc, time.monotonic()


#: what Ray 2.60 listens on every interface whatever it is told: the GCS, the raylet (node
#: manager, object manager) and every core worker's gRPC server (actors, idle workers, the
#: launcher's driver)
RAY_EVERYWHERE = ("gcs_server", "raylet", "ray::")


LOST = r"^distrun: lost Ray node 198\.18\.0\.2 \(host1\) with rank [01]: its actor cannot be " \
       r"reached \(\w+\): the node stopped or its network is down"


def test_a_lost_ray_node_is_named_and_the_run_resumes_on_what_is_left(two_node_ray, reference,
                                                                     tmp_path):
    two_node_ray.ensure_worker()
    (tmp_path / "task.py").write_text(TASK)
    proc, killed_at = _kill_host1_at_step_3(two_node_ray, tmp_path, "--ray-placement", "SPREAD",
                                            "--ray-max-restarts", "1", "--name", "lost")
    log = _finish(proc, tmp_path, timeout=240)
    print(f"from the kill to the end of the run: {time.monotonic() - killed_at:.1f} s")
    assert two_node_ray.ranks_left() == [], log
    assert proc.returncode == 0, log
    # one line for the loss, naming the lost node, not the survivor that lost its peer
    assert len(re.findall(LOST + "$", log, re.M)) == 1, log
    assert "failed with exit code" not in log and "Traceback" not in log, log
    assert "restarting all 2 ranks on Ray (restart 1 of 1)" in log
    # While both nodes ran: the ranks' servers (rank 0's store, gloo) on their node's address,
    # nothing on every interface but what Ray itself forces there.
    listening = json.loads((tmp_path / "listening.json").read_text())
    addresses = {h.name: h.address for h in two_node_ray.bed}
    for host, pid in (line.split() for line in _ranks_at_the_hold(tmp_path)):
        mine = [a for a, _, procs in listening[host] if any(p == int(pid) for _, p in procs)]
        assert mine and set(mine) == {addresses[host]}, (host, listening[host])
    for host, lst in listening.items():
        wide = [(a, port, procs) for a, port, procs in lst if a in ("*", "0.0.0.0", "::")
                and not all(n.startswith(RAY_EVERYWHERE) or p == proc.pid for n, p in procs)]
        assert wide == [], (host, lst)
    got = _result(tmp_path)
    assert got["resumed_from"] and "lost" in got["resumed_from"]
    assert got["start_step"] == 2  # the step-2 checkpoint, both ranks on host0 now
    assert got["weights"] == reference["weights"]


def test_a_lost_ray_node_without_room_left_ends_in_one_line_and_a_requeue_code(two_node_ray,
                                                                              tmp_path):
    """STRICT_SPREAD needs two nodes: once host1 is gone the group cannot be placed again."""
    two_node_ray.ensure_worker()
    (tmp_path / "task.py").write_text(TASK)
    proc, killed_at = _kill_host1_at_step_3(two_node_ray, tmp_path, "--ray-placement",
                                            "STRICT_SPREAD", "--ray-max-restarts", "1",
                                            "--ray-start-timeout", "10", "--name", "noroom")
    log = _finish(proc, tmp_path, timeout=240)
    print(f"from the kill to the end of the run: {time.monotonic() - killed_at:.1f} s")
    assert two_node_ray.ranks_left() == [], log
    assert proc.returncode == 143, log  # requeue: the newest checkpoint is there to resume
    assert len(re.findall(LOST + "$", log, re.M)) == 1, log
    last = log.strip().splitlines()[-1]
    assert re.fullmatch(
        r"distrun: the Ray cluster cannot place 2 workers of \{'CPU': 1\.0\} \(STRICT_SPREAD\) "
        r"again within 10s \(it has CPU=\d+, GPU=0\) after losing node 198\.18\.0\.2 \(host1\): "
        r"add a node \(or restart the lost one\) and run again with --resume auto; exit 143 "
        r"\(requeue\)", last), log
    assert "Traceback" not in log and "failed with exit code" not in log, log
    assert (tmp_path / "runs" / "noroom" / "checkpoints" / "step-2").is_dir()


def test_a_lost_ray_node_with_no_restart_left_ends_in_one_line_and_a_requeue_code(two_node_ray,
                                                                                 tmp_path):
    """The default, --ray-max-restarts 0: the loss is said once, with what to do."""
    two_node_ray.ensure_worker()
    (tmp_path / "task.py").write_text(TASK)
    proc, killed_at = _kill_host1_at_step_3(two_node_ray, tmp_path, "--ray-placement", "SPREAD",
                                            "--name", "norestart")
    log = _finish(proc, tmp_path, timeout=240)
    print(f"from the kill to the end of the run: {time.monotonic() - killed_at:.1f} s")
    assert two_node_ray.ranks_left() == [], log
    assert proc.returncode == 143, log
    assert re.fullmatch(LOST + r"; no restart left \(--ray-max-restarts\): run again with "
                        r"--resume auto; exit 143 \(requeue\)", log.strip().splitlines()[-1]), log
    assert len(re.findall(LOST, log, re.M)) == 1, log
    assert "Traceback" not in log and "failed with exit code" not in log, log
