"""Ray restarts and resumes a distrun task from its checkpoint; it ends where an unbroken run does.

A worker process is killed from outside (SIGKILL, as the OOM killer or a lost node would) and
the launcher's restart policy brings the group back; a finished run is continued with
``--resume latest``. Needs the ddp strategy and the safetensors checkpoint plugin; skipped with
the reason when either is missing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distrun._launch.lifeline import die_with_parent

pytest.importorskip("ray", reason="Ray is not installed (pip install ray, or tox -e contrib-ray)")
pytest.importorskip("distrun_ray", reason="distrun-ray is not installed (tox -e contrib-ray)")

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("distrun_ddp") is None,
                       reason="needs the ddp strategy: pip install distrun-ddp"),
    pytest.mark.skipif(importlib.util.find_spec("distrun_safetensors") is None,
                       reason="needs a checkpoint plugin: pip install distrun-safetensors"),
]

TASK = (Path(__file__).with_name("regress_task.py").read_text() + """


class WaitForKill:
    \"\"\"With PID_FILE set, rank 1 of the first attempt writes its pid after step 3 and waits.\"\"\"

    @distrun.hookimpl
    def distrun_on_fit_start(self, run):
        self.start_step = run.progress.step

    @distrun.hookimpl
    def distrun_on_step_end(self, run, step):
        pid_file = os.environ.get("PID_FILE")
        if pid_file and step == 3 and run.rank == 1 \\
                and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            with open(pid_file + ".tmp", "w") as fh:
                fh.write(str(os.getpid()))
            os.replace(pid_file + ".tmp", pid_file)
            time.sleep(120)  # the test kills this process; waking up here is a failure
            sys.exit(99)

    @distrun.hookimpl
    def distrun_on_fit_end(self, run):
        if run.is_global_zero:
            weights = [p.detach().flatten().tolist() for p in run.unwrapped_model().parameters()]
            with open(sys.argv[1], "w") as fh:
                json.dump({"start_step": self.start_step, "step": run.progress.step,
                           "resumed_from": run.resumed_from, "weights": weights}, fh)


if __name__ == "__main__":
    distrun.Trainer(plugins=(WaitForKill(),)).fit(Regress())
""")

COMMON = ["--strategy", "ddp", "--max-epochs", "10", "--batch-size", "8",
          "--ckpt-every-n-steps", "2", "--no-summary"]


@pytest.fixture(scope="module")
def ray_reference(h, tmp_path_factory) -> dict:
    """The unbroken 6-step run under the local launcher."""
    folder = tmp_path_factory.mktemp("reference")
    (folder / "task.py").write_text(TASK)
    ref = h.distrun("run", "--nproc-per-node", "2", *COMMON, "--max-steps", "6", "--name", "ref",
                    "task.py", str(folder / "ref.json"), cwd=folder)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    got = _result(folder / "ref.json")
    assert (got["start_step"], got["step"], got["resumed_from"]) == (0, 6, None)
    return got


def _ray(ray_address: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "distrun", "run", "--launcher", "ray", "--ray-address",
            ray_address, "--ray-num-workers", "2", *args]


def _result(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_resumes_from_the_checkpoint(h, tmp_path, ray_address,
                                                                      ray_reference):
    (tmp_path / "task.py").write_text(TASK)
    pid_file = tmp_path / "rank1.pid"
    proc = subprocess.Popen(
        _ray(ray_address, "--ray-max-restarts", "1", "--ray-env", "PID_FILE", *COMMON,
             "--max-steps", "6", "--name", "killed", "task.py", str(tmp_path / "ray.json")),
        cwd=tmp_path, env=h.clean_env(PID_FILE=str(pid_file)), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, preexec_fn=die_with_parent())
    try:
        deadline = time.monotonic() + 180
        while not pid_file.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "rank 1 never reached step 3"
            time.sleep(0.1)
        pid = int(pid_file.read_text())
        os.kill(pid, signal.SIGKILL)  # the worker process itself, on the Ray node
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out + err
    # one line for the failure: rank 1 with 137 (128 + SIGKILL) here; if rank 0's gloo error
    # reaches the launcher in the same poll, the launcher names rank 0 (signals rank last)
    assert re.search(r"^distrun: rank [01] \(Ray node 127\.0\.0\.1\) failed with exit code "
                     r"\d+", err, re.M), err
    assert "restarting all 2 ranks on Ray (restart 1 of 1)" in err
    got = _result(tmp_path / "ray.json")
    assert got["resumed_from"] and "killed" in got["resumed_from"]
    assert got["start_step"] == 2  # the step-2 checkpoint; step 3 died with rank 1
    assert got["step"] == ray_reference["step"] == 6
    # CPU, fixed seed, global data cursor: the resumed run ends with the same weights
    assert got["weights"] == ray_reference["weights"]


@pytest.mark.slow
def test_resume_latest_continues_a_finished_ray_run(h, tmp_path, ray_address, ray_reference):
    (tmp_path / "task.py").write_text(TASK)
    first = subprocess.run(
        _ray(ray_address, *COMMON, "--max-steps", "4", "--name", "cont", "task.py",
             str(tmp_path / "first.json")),
        cwd=tmp_path, env=h.clean_env(), capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    assert _result(tmp_path / "first.json")["step"] == 4
    second = subprocess.run(
        _ray(ray_address, *COMMON, "--max-steps", "6", "--resume", "latest", "--name", "cont",
             "task.py", str(tmp_path / "second.json")),
        cwd=tmp_path, env=h.clean_env(), capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stdout + second.stderr
    got = _result(tmp_path / "second.json")
    assert got["resumed_from"] and "step-" in got["resumed_from"]
    assert (got["start_step"], got["step"]) == (4, 6)
    assert got["weights"] == ray_reference["weights"]


@pytest.mark.slow
def test_resume_latest_without_a_checkpoint_is_a_usage_error(h, tmp_path, ray_address):
    (tmp_path / "task.py").write_text(TASK)
    result = h.distrun("run", "--launcher", "ray", "--ray-address", ray_address,
                       "--ray-num-workers", "2", *COMMON, "--max-steps", "2", "--resume",
                       "latest", "--name", "fresh", "task.py", str(tmp_path / "x.json"),
                       cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error: no checkpoint found in runs/fresh/checkpoints (train with --ckpt-every-n-steps N "
        "first, or use --resume auto)")
