"""Helpers of the elastic tests: a hermetic plugin set, records, a background launcher."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from distrun.plugin import die_with_parent

HERE = Path(__file__).resolve().parent
TASK = str(HERE / "elastic_task.py") + ":ElasticTask"
#: the run every recovery test compares with: 2 ranks, 2 epochs of 16 steps, 36 steps in all
TRAIN = ["--strategy", "gradsum", "--nproc-per-node", "2", "--batch-size", "16",
         "--max-epochs", "3", "--max-steps", "36", "--log-every-n-steps", "4", "--no-summary",
         "--timeout", "60"]


def plugin_env(record_dir: Path, **extra: str) -> dict[str, str]:
    """Only core, elastic, safetensors and the test plugin, whatever else is installed."""
    record_dir.mkdir(parents=True, exist_ok=True)
    env = {
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "DISTRUN_DISABLE_PLUGIN_AUTOLOAD": "1",
        "DISTRUN_PLUGINS": "distrun_elastic.plugin,distrun_safetensors.plugin,elastic_faults",
        "EL_RECORD_DIR": str(record_dir),
        "OMP_NUM_THREADS": "1",
    }
    env.update(extra)
    return env


def records(record_dir: Path, name: str) -> list[dict[str, Any]]:
    path = record_dir / name
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def final_weights(record_dir: Path) -> dict[str, Any]:
    import torch

    return torch.load(record_dir / "final.pt", weights_only=True)


def steps_trained(record_dir: Path) -> dict[int, list[int]]:
    """Global sample indices of each step (ranks in order), the last time the step was trained.

    A step trained again (a replay after a restart, or at another world size) replaces the
    earlier records of that step.
    """
    out: dict[int, dict[str, Any]] = {}
    for rec in records(record_dir, "samples.jsonl"):
        entry = out.get(rec["step"])
        if entry is None or entry["world"] != rec["world"] or rec["rank"] in entry["idx"]:
            entry = out[rec["step"]] = {"world": rec["world"], "idx": {}}
        entry["idx"][rec["rank"]] = rec["idx"]
    return {step: [i for r in sorted(e["idx"]) for i in e["idx"][r]]
            for step, e in sorted(out.items())}


class Launcher:
    """A `distrun run` in the background whose output is collected in a file."""

    def __init__(self, args: list[str], env: dict[str, str], cwd: Path, name: str) -> None:
        self.log = cwd / f"{name}.out"
        full_env = {**os.environ, **env}
        self._fh = open(self.log, "w")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen([sys.executable, "-m", "distrun", "run", *args], cwd=cwd,
                                     env=full_env, stdout=self._fh, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=die_with_parent())

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output():
            if self.proc.poll() is not None:
                raise AssertionError(f"launcher exited before {text!r}:\n{self.output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} within {timeout}s:\n{self.output()}")
            time.sleep(0.2)

    def wait_until(self, predicate: Any, what: str, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.proc.poll() is not None:
                raise AssertionError(f"launcher exited before {what}:\n{self.output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout}s:\n{self.output()}")
            time.sleep(0.2)

    def wait(self, timeout: float = 240.0) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._fh.close()

    def kill_all(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
