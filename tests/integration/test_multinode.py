"""Two `distrun run` launchers on one machine act as two nodes over torch's own rendezvous.

Static: ``--nnodes 2 --node-rank 0/1 --master-addr 127.0.0.1 --master-port P`` (the core
launcher, env:// TCPStore hosted by node 0). Elastic: ``--nnodes 1:2`` through the elastic
plugin's c10d rendezvous, skipped with the reason when that plugin is not installed or has no
launcher yet.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from distrun._launch.lifeline import die_with_parent
from distrun.testing import free_port

SUM_RANKS = """
import datetime, json, os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
t = torch.tensor([float(dist.get_rank())])
dist.all_reduce(t)
info = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK",
                                       "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
info.update(sum=t.item(), world=dist.get_world_size())
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as fh:
    json.dump(info, fh)
dist.destroy_process_group()
"""

_SCHEDULER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_", "PET_", "KUBERNETES_")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_SCHEDULER_PREFIXES)
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _two_nodes(tmp_path: Path, per_node: list[list[str]], timeout: float = 240) -> list[str]:
    script = tmp_path / "sum_ranks.py"
    script.write_text(SUM_RANKS)
    procs = [subprocess.Popen([sys.executable, "-m", "distrun", "run", *args, str(script),
                               str(tmp_path)], env=_env(), cwd=tmp_path, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              preexec_fn=die_with_parent())
             for args in per_node]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outputs.append(out)
            assert p.returncode == 0, out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outputs


def _ranks(tmp_path: Path, world: int) -> list[dict]:
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
def test_static_two_nodes_four_processes(tmp_path):
    port = free_port()
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
              "--master-port", str(port), "--name", "static2x2"]
    _two_nodes(tmp_path, [[*common, "--node-rank", "0"], [*common, "--node-rank", "1"]])
    infos = _ranks(tmp_path, 4)
    for rank, info in enumerate(infos):
        assert info["RANK"] == str(rank) and info["WORLD_SIZE"] == "4"
        assert info["GROUP_RANK"] == str(rank // 2) and info["LOCAL_RANK"] == str(rank % 2)
        assert info["LOCAL_WORLD_SIZE"] == "2" and info["MASTER_PORT"] == str(port)
        assert info["world"] == 4 and info["sum"] == 6.0  # 0+1+2+3 over one gloo group


def _elastic_launcher() -> str | None:
    """Why the elastic test cannot run here, or None when it can."""
    proc = subprocess.run([sys.executable, "-m", "distrun", "plugins", "--json"], env=_env(),
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        return f"`distrun plugins` failed: {proc.stderr.strip()[-200:]}"
    plugins = {p["name"]: p for p in json.loads(proc.stdout)}
    if "elastic" not in plugins:
        return "the elastic plugin (distrun-elastic) is not installed"
    if "distrun_launch" not in plugins["elastic"]["hooks"]:
        return "the elastic plugin has no launcher (distrun_launch) yet"
    help_text = subprocess.run([sys.executable, "-m", "distrun", "run", "--help"], env=_env(),
                               capture_output=True, text=True, timeout=120).stdout
    if "--rdzv-endpoint" not in help_text:
        return "the elastic plugin does not offer --rdzv-endpoint"
    return None


@pytest.mark.slow
def test_elastic_one_to_two_nodes(tmp_path):
    reason = _elastic_launcher()
    if reason:
        pytest.skip(reason)
    port = free_port()
    common = ["--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-endpoint",
              f"127.0.0.1:{port}", "--rdzv-id", "elastic-it", "--name", "elastic1to2"]
    _two_nodes(tmp_path, [common, common], timeout=300)
    # Both launchers joined one round: four ranks of one group (node ranks are assigned by the
    # rendezvous, so only the set of ranks and the sum are fixed).
    infos = _ranks(tmp_path, 4)
    assert sorted(int(i["RANK"]) for i in infos) == [0, 1, 2, 3]
    assert {i["WORLD_SIZE"] for i in infos} == {"4"}
    assert all(i["world"] == 4 and i["sum"] == 6.0 for i in infos)
