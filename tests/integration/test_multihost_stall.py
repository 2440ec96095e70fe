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
import subprocess
import sys
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
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(CORE_TESTS), str(ROOT)]),
               STALL_IN="step", STALL_AT="20", STALL_RANK="1",
               STALL_MARK=str(tmp_path / "fault"))
    return env


def _stall_two_hosts(bed, tmp_path: Path, **env: str) -> list[str]:
    """One launcher and one rank on each host, rank 1 hanging at step 20: the launchers'
    outputs, once both ended with exit code 1."""
    port = str(next(PORTS))
    logs, procs = [], []
    for host in bed:
        log = tmp_path / f"node{host.index}.log"
        args = ["--nnodes", "2", "--node-rank", str(host.index), "--nproc-per-node", "1",
                "--master-addr", "198.18.0.1", "--master-port", port, "--stall-timeout", "5",
                "--timeout", "90", "--run-dir", str(tmp_path / "run"), "--batch-size", "16",
                "stall_task:StallTask"]
        with open(log, "w") as fh:
            procs.append(host.popen([sys.executable, "-m", "distrun", "run", *args],
                                    env={**_env(tmp_path), **env}, cwd=tmp_path, stdout=fh,
                                    stderr=subprocess.STDOUT))
        logs.append(log)
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
