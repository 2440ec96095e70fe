"""The shm backend refuses ranks on two hosts, also when the launcher cannot know.

Two network-namespace hosts of one machine (distrun.testing.hosts) share its boot id and its
/dev/shm, so shared memory would even work between them: the backend must still see two hosts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.multihost

#: one rank of a 2-rank shm group over env:// (as torchrun or a scheduler would start it)
RANK = textwrap.dedent("""
    import datetime, os, sys
    import torch, torch.distributed as dist
    from distrun_shm.backend import load
    load()
    try:
        dist.init_process_group("shm", timeout=datetime.timedelta(seconds=60))
    except Exception as exc:
        print(f"{type(exc).__name__}: {exc}")
        sys.exit(0)
    t = torch.ones(1)
    dist.all_reduce(t)
    print("formed a group, sum", t.item())
    dist.destroy_process_group()
""")


def _env(rank: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMI_", "TORCHELASTIC_", "PET_"))}
    env.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="198.18.0.1", MASTER_PORT="29500",
               OMP_NUM_THREADS="1")
    return env


def test_a_group_over_two_hosts_of_one_name_is_refused_in_one_line(distrun_hosts):
    bed = distrun_hosts(2)
    # Both hosts named alike: only their network namespaces tell them apart.
    procs = [bed[r].popen([sys.executable, "-c", RANK], env=_env(r), hostname="node",
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in (0, 1)]
    outs = [p.communicate(timeout=120)[0].strip().splitlines()[-1] for p in procs]
    for rank, out in enumerate(outs):
        assert out == (
            f"UsageError: the shm backend reaches ranks of one machine only, but rank "
            f"{1 - rank} runs on node (another host of that name) and rank {rank} on node: use "
            "--backend gloo for a run over several nodes"), outs


def test_the_launchers_of_two_hosts_refuse_shm_in_one_line(distrun_hosts, tmp_path):
    bed = distrun_hosts(2)
    script = tmp_path / "noop.py"
    script.write_text("print('a worker started')\n")
    procs = [host.popen([sys.executable, "-m", "distrun", "run", "--nnodes", "2", "--node-rank",
                         str(host.index), "--master-addr", bed[0].address, "--master-port",
                         "29500", "--backend", "shm", str(script)], env=_env(host.index),
                        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for host in bed]
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2 and out == "", err
        assert err.splitlines() == [
            "error: backend 'shm' reaches the ranks of one machine only, but --nnodes is 2 "
            "(use --backend gloo for several nodes)"]
