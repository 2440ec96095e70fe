"""A local Ray cluster on 127.0.0.1 for this folder's tests (each module skips without Ray)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

_SCHEDULER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_", "PET_", "KUBERNETES_",
                       "RAY_ADDRESS")


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    """`ray start --head` on 127.0.0.1 (4 logical CPUs), stopped with its processes after."""
    from distrun_ray.local_cluster import LocalRayCluster

    cluster = LocalRayCluster(num_cpus=4, start_timeout=180)
    cluster.start()
    try:
        yield cluster
    finally:
        left = cluster.stop()
        assert not left, f"Ray processes left after stopping the head: {sorted(left)}"


@pytest.fixture(scope="session")
def ray_address(ray_cluster: Any) -> str:
    """The address of the session's Ray head (``127.0.0.1:PORT``)."""
    return ray_cluster.address


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_SCHEDULER_PREFIXES)
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def distrun(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 300
            ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "distrun", *args], cwd=cwd,
                          env=env or clean_env(), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def h() -> SimpleNamespace:
    """This folder's helpers (test modules cannot import conftest under --import-mode=importlib)."""
    return SimpleNamespace(clean_env=clean_env, distrun=distrun)
