"""Bad input of issue 26: a second live run on a folder another run is using.

Two runs on one run folder lost metrics rows, and two runs sharing ``--ckpt-dir`` overwrote
each other's checkpoints. A run holds a lock on its folders for its life (an flock the kernel
frees when it dies): a second run is refused in one line and exit code 2; the same run (its
workers, its restarts, a resume after it ended, a run after it was killed) is not.
Real ``distrun`` processes: the first run waits, training, until the test lets it finish.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from distrun.testing import run_cli

HOLD = """
import os, sys, time
import torch
import distrun


class T(distrun.Task):
    def configure_model(self):
        return torch.nn.Linear(2, 1)

    def train_data(self):
        g = torch.Generator().manual_seed(0)
        return torch.utils.data.TensorDataset(torch.randn(16, 2, generator=g),
                                              torch.randn(16, 1, generator=g))

    def training_step(self, model, batch):
        if not os.path.exists("go"):
            print("training", flush=True)
            deadline = time.monotonic() + 120  # the test lets it go long before
            while not os.path.exists("go") and time.monotonic() < deadline:
                time.sleep(0.05)
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)


if __name__ == "__main__":
    distrun.fit(T(), batch_size=16, summary=False)
"""
FLAGS = ("-p", "no:progress", "run", "--no-summary", "--batch-size", "16")
IN_USE = (r"error: {label} {folder} is in use by another live run \(pid \d+ on \S+, since "
          r"[\d-]+ [\d:]+\): wait for it to end, or give this run another {flag}")


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip() and "progress" not in ln]


@pytest.fixture
def work(tmp_path: Path) -> Path:
    (tmp_path / "hold.py").write_text(HOLD)
    return tmp_path


@contextmanager
def live_run(work: Path, *args: str, python: bool = False,
             env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """A run that trains until ``work/go`` exists; yields once it is training."""
    cmd = [sys.executable, "hold.py"] if python else \
        [sys.executable, "-m", "distrun", *FLAGS, *args, "hold.py:T"]
    proc = subprocess.Popen(cmd, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    seen: list[str] = []
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            seen.append(line)
            if line.strip() == "training":
                break
        else:
            pytest.fail(f"the first run ended before training: {''.join(seen)}")
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]


def _finish(work: Path, proc: subprocess.Popen) -> int:
    (work / "go").touch()
    rest = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, rest
    return proc.returncode


def test_a_second_live_run_on_a_run_folder_is_refused_and_the_same_run_later_is_not(work):
    pytest.importorskip("distrun_safetensors", reason="continuing a run folder is --resume")
    with live_run(work, "--run-dir", "r") as first:
        second = run_cli(*FLAGS, "--run-dir", "r", "--resume", "auto", "hold.py:T", cwd=work,
                         timeout=120)
        assert second.returncode == 2, second
        lines = _lines(second.stderr)
        assert len(lines) == 1 and re.fullmatch(IN_USE.format(
            label="the run folder", folder="r", flag="--name or --run-dir"), lines[0]), second
        assert not (work / "r" / "logs" / "rank0.log").read_text().count("error"), \
            "the refused run wrote into the first one's folder"
        _finish(work, first)
    # the same folder once its run ended: --resume continues it
    again = run_cli(*FLAGS, "--run-dir", "r", "--resume", "auto", "hold.py:T", cwd=work,
                    timeout=120)
    assert again.returncode == 0, again


@pytest.mark.slow
def test_a_killed_run_does_not_block_the_next(work):
    pytest.importorskip("distrun_safetensors", reason="continuing a run folder is --resume")
    with live_run(work, "--run-dir", "r") as first:
        os.killpg(first.pid, signal.SIGKILL)  # the launcher and its workers, at once
        first.wait()
    (work / "go").touch()
    after = run_cli(*FLAGS, "--run-dir", "r", "--resume", "auto", "hold.py:T", cwd=work,
                    timeout=120)
    assert after.returncode == 0, after


@pytest.mark.slow
def test_a_second_live_run_on_a_checkpoint_folder_is_refused(work):
    pytest.importorskip("distrun_safetensors", reason="--ckpt-dir is the checkpoint plugin's")
    with live_run(work, "--name", "a", "--ckpt-dir", "shared") as first:
        second = run_cli(*FLAGS, "--name", "b", "--ckpt-dir", "shared", "hold.py:T", cwd=work,
                         timeout=120)
        assert second.returncode == 2, second
        lines = _lines(second.stderr)
        assert len(lines) == 1 and re.fullmatch(IN_USE.format(
            label="--ckpt-dir", folder="shared", flag="--ckpt-dir"), lines[0]), second
        assert not (work / "runs" / "b").exists(), "the refused run left its run folder"
        # a folder inside a live run's folder is that run's too
        inside = run_cli(*FLAGS, "--name", "c", "--ckpt-dir", "runs/a/checkpoints",
                         "hold.py:T", cwd=work, timeout=120)
        assert inside.returncode == 2, inside
        assert re.fullmatch(r"error: --ckpt-dir runs/a/checkpoints is inside runs/a, which "
                            r"holds another live run \(pid \d+ on \S+, since [\d-]+ [\d:]+\): "
                            r"wait for it to end, or give this run another --ckpt-dir",
                            _lines(inside.stderr)[0]), inside
        _finish(work, first)


@pytest.mark.slow
def test_a_second_process_training_into_the_same_folder_without_a_launcher_is_refused(work):
    # `python train.py` twice with one --run-dir: rank 0 of each holds the lock itself
    env = {"DISTRUN_RUN_DIR": "r"}
    with live_run(work, python=True, env=env) as first:
        second = subprocess.run([sys.executable, "hold.py"], cwd=work, text=True,
                                capture_output=True, timeout=120,
                                env={**os.environ, "OMP_NUM_THREADS": "1", **env})
        assert second.returncode == 2, second.stderr
        lines = _lines(second.stderr)
        assert len(lines) == 1 and re.fullmatch(IN_USE.format(
            label="the run folder", folder="r", flag="--name or --run-dir"), lines[0]), second
        _finish(work, first)
