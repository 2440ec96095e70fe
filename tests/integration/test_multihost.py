"""Static multi-node runs on real network hosts (distrun.testing.hosts: namespaces, own names).

One ``distrun run --nnodes 2 --node-rank R --master-addr 198.18.0.1`` launcher per host, as on
two machines:

- a host whose own name resolves to 127.0.1.1 (the classic hang at init) is refused in one line
  naming ``--local-addr``, and runs with it (static and c10d rendezvous).
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from distrun.testing import HostSpec

pytestmark = pytest.mark.multihost

ROOT = Path(__file__).resolve().parents[2]
#: any port does (each testbed has its own), but not one a run just used: its connections wait
#: in TIME_WAIT there for a minute, and the launcher's port check (a bind without
#: SO_REUSEADDR) takes that for "in use"
PORTS = itertools.count(29500)


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The test's environment without any scheduler's or torchrun's variables."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_", "PET_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                         "GLOO_SOCKET_IFNAME")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **(extra or {}))
    return env


def _launch(bed, args: list[list[str]], cwd: Path, env: dict[str, str] | None = None,
            timeout: float = 300) -> list[tuple[int, str]]:
    """``distrun run ARGS[K]`` on each host K at once; (exit code, output) of each."""
    logs = [cwd / f"node{h.index}.log" for h in bed]
    procs = []
    for host, log in zip(bed, logs):
        with open(log, "w") as fh:
            procs.append(host.popen([sys.executable, "-m", "distrun", "run", *args[host.index]],
                                    env=_env(env), cwd=cwd, stdout=fh, stderr=subprocess.STDOUT))
    codes = [p.wait(timeout=timeout) for p in procs]
    return [(c, log.read_text()) for c, log in zip(codes, logs)]


def _static(bed, nproc: int, master: str = "198.18.0.1"):
    """The static flags of each host (a fresh master port for each call)."""
    port = str(next(PORTS))
    return lambda host: ["--nnodes", str(len(bed)), "--node-rank", str(host.index),
                         "--nproc-per-node", str(nproc), "--master-addr", master,
                         "--master-port", port]


SUM = """
import datetime, socket
import torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
t = torch.tensor([float(dist.get_rank())])
dist.all_reduce(t)
print("sum", t.item(), "on", socket.gethostname())
dist.destroy_process_group()
"""


def test_a_host_named_after_loopback_is_refused_in_one_line(distrun_hosts, tmp_path):
    """Its gloo would announce 127.0.1.1 and the other node would wait for it until the
    timeout: refused before any worker starts, the fix named."""
    bed = distrun_hosts([HostSpec(), HostSpec(own_name="loopback")])
    (tmp_path / "sum.py").write_text(SUM)
    refused = ("error: this host's name 'host1' resolves to 127.0.1.1 (the loopback), so the "
               "other nodes could not reach its ranks and the run would hang at init: pass "
               "--local-addr 198.18.0.2 (this node's address on the network the nodes share), "
               "or map host1 to it in /etc/hosts")
    static = _static(bed, 1)(bed[1])
    elastic = ["--nnodes", "2", "--rdzv-endpoint", "198.18.0.1:29400", "--rdzv-id", "j"]
    for args in (static, elastic):
        proc = bed[1].run([sys.executable, "-m", "distrun", "run", *args, "sum.py"],
                          env=_env(), cwd=tmp_path, timeout=120)
        assert proc.returncode == 2 and proc.stdout == "", proc
        assert proc.stderr.splitlines() == [refused]
    bad = bed[1].run([sys.executable, "-m", "distrun", "run", *static, "--local-addr",
                      "198.18.0.1", "sum.py"], env=_env(), cwd=tmp_path, timeout=120)
    assert bad.returncode == 2 and bad.stderr.splitlines() == [
        "error: --local-addr 198.18.0.1: it is not an address of this host (its addresses: "
        "127.0.0.1 (lo), 198.18.0.2 (eth0))"]


@pytest.mark.slow
@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_a_host_named_after_loopback_runs_with_local_addr(distrun_hosts, tmp_path, rendezvous):
    bed = distrun_hosts([HostSpec(), HostSpec(own_name="loopback")])
    (tmp_path / "sum.py").write_text(SUM)

    static = _static(bed, 1)
    c10d = ["--nnodes", "2", "--rdzv-endpoint", "198.18.0.1:29400", "--rdzv-id", "j"]
    args = [[*(static(h) if rendezvous == "static" else c10d), "--local-addr", h.address,
             "sum.py"] for h in bed]
    results = _launch(bed, args, tmp_path, timeout=240)
    for (code, out), host in zip(results, bed):
        assert code == 0, out
        assert f"sum 1.0 on {host.name}" in out.splitlines()
