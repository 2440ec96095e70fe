"""Helpers of the cluster-environment tests: a scheduler-free base environment and a probe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from distrun._launch.lifeline import die_with_parent

#: variables a scheduler or launcher may have left in the test's own environment
_SCHEDULER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "TORCHELASTIC_", "PET_",
                       "KUBERNETES_", "DISTRUN_CLUSTER_ENV")
_TORCHRUN_VARS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ROLE_RANK"}

#: a torchrun script: writes its torchrun variables and the sum of ranks over a gloo group
PROBE = """
import datetime, json, os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
t = torch.tensor([float(dist.get_rank())])
dist.all_reduce(t)
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
        "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"]
info = {k: os.environ.get(k) for k in keys}
info["sum"] = t.item()
info["group_world"] = dist.get_world_size()
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as fh:
    json.dump(info, fh)
dist.destroy_process_group()
"""


def base_env(**extra: str) -> dict[str, str]:
    """The test's environment without scheduler variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_SCHEDULER_PREFIXES) and k not in _TORCHRUN_VARS}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def cli_env(**extra: str) -> dict[str, str | None]:
    """``base_env`` for the in-process ``cli`` fixture: scheduler variables unset, plus ``extra``."""
    env: dict[str, str | None] = {k: None for k in os.environ if k not in base_env()}
    env.update(extra)
    return env


def distrun(*args: str, env: dict[str, str], cwd: Path, timeout: float = 180
            ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "distrun", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def start(*args: str, env: dict[str, str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "distrun", *args], env=env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=die_with_parent())


def finish(procs: list[subprocess.Popen], timeout: float = 180) -> list[tuple[int, str]]:
    """Wait for every launcher (killing all on timeout); their (exit code, output)."""
    out = []
    try:
        for p in procs:
            text, _ = p.communicate(timeout=timeout)
            out.append((p.returncode, text))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def read_ranks(folder: Path, world: int) -> list[dict]:
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    path = tmp_path / "probe.py"
    path.write_text(PROBE)
    return path


@pytest.fixture
def h() -> SimpleNamespace:
    """This folder's helpers (test modules cannot import conftest under --import-mode=importlib)."""
    return SimpleNamespace(base_env=base_env, cli_env=cli_env, distrun=distrun, finish=finish,
                           read_ranks=read_ranks, start=start)
