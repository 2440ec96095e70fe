"""Helpers of the --ft tests: a launcher run in the background, tied to the test process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from distrun.testing import descendants

pytest.importorskip("torchft")
pytest.importorskip("distrun_ft")

HERE = Path(__file__).parent
_SCHEDULER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_", "PET_",
                       "KUBERNETES_", "TORCHFT_", "DISTRUN_FT_")


def ft_env(record: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_SCHEDULER_PREFIXES)
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(HERE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        DISTRUN_PLUGINS="ft_task", FT_RECORD=str(record))
    env.update(extra)
    return env


class Launch:
    """``distrun run ARGS`` in the background; it dies with the test process (kill -9 too),
    and is killed with its process group at the end of the test, passed or failed."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str]) -> None:
        from distrun.plugin import die_with_parent

        self.out = open(cwd / "launcher.out", "w+")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen([sys.executable, "-m", "distrun", "run", *args],
                                     cwd=cwd, env=env, stdout=self.out,
                                     stderr=subprocess.STDOUT, text=True,
                                     preexec_fn=die_with_parent(), start_new_session=True)
        self.descendants: set[int] = set()

    def watch(self) -> None:
        """Remember every process below the launcher now (checked dead at the end)."""
        from distrun.plugin import ProcessId  # noqa: F401 (import check)

        self.descendants.update(descendants(self.proc.pid))

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            self.watch()
            if time.monotonic() > deadline:
                raise AssertionError(f"the launcher still runs after {timeout:g}s:\n"
                                     f"{self.output()[-4000:]}")
            time.sleep(0.2)
        return self.proc.returncode

    def output(self) -> str:
        self.out.flush()
        return Path(self.out.name).read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:  # a stop as a user's: the launcher cleans up after itself
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        if self.proc.poll() is None:
            for pid in [self.proc.pid, *descendants(self.proc.pid)]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.wait()
        for pid in self.descendants:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.out.close()



def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(paths: list[Path], launch: Launch, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        launch.watch()
        if launch.proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"never appeared: {[str(p) for p in paths if not p.exists()]}"
                                 f"\n{launch.output()[-4000:]}")
        time.sleep(0.05)


def rows(record: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted(record.glob("replica*-rank*.jsonl")):
        rank = int(path.stem.rsplit("rank", 1)[1])
        for line in path.read_text().splitlines():
            out.append({**json.loads(line), "rank": rank})
    return out


@pytest.fixture
def launch(tmp_path: Path):
    started: list[Launch] = []

    def start(*args: str, env: dict[str, str] | None = None) -> Launch:
        started.append(Launch(list(args), tmp_path, env or ft_env(tmp_path)))
        return started[-1]

    yield start
    for one in started:
        one.stop()


@pytest.fixture(scope="session")
def ft() -> SimpleNamespace:
    """This folder's helpers (test modules cannot import conftest under importlib mode)."""
    return SimpleNamespace(env=ft_env, alive=alive, wait_for=wait_for, rows=rows)
