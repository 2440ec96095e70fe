"""A rank on another host stalls: the launcher of the host a user watches names it.

Two namespace hosts (distrun.testing.hosts), one ``distrun run --nnodes 2`` launcher and one
rank on each; rank 1, on host 1, hangs in its training_step. Each launcher sees only its own
rank; their ranks share the nodes' reports through the run's store
(distrun._diagnose.exchange), so host 0's launcher, whose rank only waits, prints the line
that names rank 1 on host 1.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.multihost

ROOT = Path(__file__).resolve().parents[2]
CORE_TESTS = ROOT / "tests" / "core"
PORTS = itertools.count(29700)


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_", "PET_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                         "GLOO_SOCKET_IFNAME")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
                   [str(CORE_TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")]),
               STALL_IN="step", STALL_AT="20", STALL_RANK="1",
               STALL_MARK=str(tmp_path / "fault"))
    return env


def _start_two_hosts(bed, tmp_path: Path, stall_timeout: str, **env: str,
                     ) -> tuple[list[subprocess.Popen], list[Path]]:
    """One launcher and one rank on each host, rank 1 hanging at step 20: the launchers and
    their logs."""
    port = str(next(PORTS))
    logs, procs = [], []
    for host in bed:
        log = tmp_path / f"node{host.index}.log"
        args = ["--nnodes", "2", "--node-rank", str(host.index), "--nproc-per-node", "1",
                "--master-addr", "198.18.0.1", "--master-port", port, "--stall-timeout",
                stall_timeout, "--timeout", "90", "--run-dir", str(tmp_path / "run"),
                "--batch-size", "16", "stall_task:StallTask"]
        with open(log, "w") as fh:
            procs.append(host.popen([sys.executable, "-m", "distrun", "run", *args],
                                    env={**_env(tmp_path), **env}, cwd=tmp_path, stdout=fh,
                                    stderr=subprocess.STDOUT))
        logs.append(log)
    return procs, logs


def _stall_two_hosts(bed, tmp_path: Path, **env: str) -> list[str]:
    """:func:`_start_two_hosts` with a 5 s stall limit: the launchers' outputs, once both
    ended with exit code 1."""
    procs, logs = _start_two_hosts(bed, tmp_path, "5", **env)
    codes = [p.wait(timeout=180) for p in procs]
    outs = [log.read_text(errors="replace") for log in logs]
    assert codes == [1, 1], outs
    return outs


def test_a_rank_stalled_on_another_host_is_named_by_this_hosts_launcher(distrun_hosts,
                                                                         tmp_path):
    bed = distrun_hosts(2)
    outs = _stall_two_hosts(bed, tmp_path)
    host1 = bed[1].name
    for out in outs:  # both launchers print the whole picture
        stall = [ln for ln in out.splitlines() if ln.startswith("error: stall")]
        assert len(stall) == 1, out
        assert re.search(rf"^error: stall at step 20: rank 1 \(host {re.escape(host1)}, pid \d+\) "
                         r"in training_step for \d+ s at stall_task\.py:\d+ \(time\.sleep\(600\)\);"
                         r" rank 0 in backward for \d+ s; stacks: ", stall[0]), stall
    # each host keeps its evidence; host 0's holds rank 1's stack, sent from host 1
    run = tmp_path / "run"
    assert sorted(p.name for p in run.glob("stall-*")) == ["stall-1-node0", "stall-1-node1"]
    assert "in training_step" in (run / "stall-1-node0" / "rank1.txt").read_text()


def test_a_host_whose_ranks_cannot_report_is_said_to_be_unseen_not_blameless(distrun_hosts,
                                                                           tmp_path):
    """Rank 1 stops itself (SIGSTOP): it cannot hand its host's report on. Host 0's launcher
    sees only its own rank waiting, and says that host 1's ranks are not seen, where it used
    to conclude that no rank was behind; host 1's launcher names the stopped rank."""
    bed = distrun_hosts(2)
    outs = _stall_two_hosts(bed, tmp_path, STALL_HOW="stop")
    lines = [[ln for ln in out.splitlines() if ln.startswith("error: stall")] for out in outs]
    assert [len(found) for found in lines] == [1, 1], outs
    assert re.search(r"^error: stall at step 20: rank 0 in backward for \d+ s; the ranks of node "
                     r"1 are not seen here \(its report did not come in time; that node's "
                     r"launcher prints its own line\); stacks: ", lines[0][0]), lines
    assert "no rank is behind" not in lines[0][0]
    assert re.search(rf"^error: stall at step 20: rank 1 \(host {re.escape(bed[1].name)}, "
                     r"pid \d+\) is stopped \(SIGSTOP", lines[1][0]), lines


def test_distrun_stacks_on_one_host_shows_the_rank_stuck_on_the_other(distrun_hosts, tmp_path):
    """``distrun stacks`` typed on host 0, whose rank only waits, while rank 1 on host 1 hangs
    (no stall yet: the limit is 60 s): its ranks ask host 1's through the run's store, and the
    line names rank 1, its host and its line, and the evidence holds rank 1's stack."""
    bed = distrun_hosts(2)
    procs, logs = _start_two_hosts(bed, tmp_path, "60")
    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / "fault").exists():
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, \
                [log.read_text(errors="replace") for log in logs]
            time.sleep(0.2)
        time.sleep(1.0)
        started = time.monotonic()
        looked = bed[0].run([sys.executable, "-m", "distrun", "stacks", str(tmp_path / "run")],
                            env=_env(tmp_path), cwd=tmp_path, timeout=60)
        took = time.monotonic() - started
        assert all(p.poll() is None for p in procs)  # a look stops nothing
        stuck = re.search(r"rank 1 \(host \S+, pid (\d+)\)", looked.stdout)
        if stuck:  # the run ends at once (a stop with grace would wait for the sleep)
            os.kill(int(stuck.group(1)), signal.SIGKILL)
            for p in procs:
                p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert looked.returncode == 0, looked
    out = looked.stdout
    assert re.search(rf"^positions at step 20: rank 1 \(host {re.escape(bed[1].name)}, pid \d+\) "
                     r"in training_step for \d+ s at stall_task\.py:\d+ \(time\.sleep\(600\)\); "
                     r"rank 0 in backward for \d+ s; stacks: .*/run/stacks-1/$", out.strip()), looked
    assert took < 15, took  # the other host answers within a look or two of its ranks
    assert "in training_step" in (tmp_path / "run" / "stacks-1" / "rank1.txt").read_text()
