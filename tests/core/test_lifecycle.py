"""How runs end, as a user launches them: exit codes, orphans, stop requests, under load.

Every test here runs real ``distrun run`` launches with a CPU-bound process per core
(``busy_cores``): the races these guard against (an abort at interpreter exit, a worker
outliving its launcher, a rank honouring a stop a step late) hide on a quiet machine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distrun._launch.lifeline import die_with_parent, pid_alive
from distrun.testing import run_cli

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from lifecycle_task import NEVER_DESTROYS, records  # noqa: E402

TASK = f"{HERE / 'lifecycle_task.py'}:Steps"
ABORT = "terminate called"


def _env(rec: Path, **extra: str) -> dict[str, str]:
    rec.mkdir(exist_ok=True)
    return {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
            "DISTRUN_PLUGINS": "lifecycle_task", "LC_REC": str(rec), "OMP_NUM_THREADS": "1",
            "DISTRUN_TIMEOUT": "60", "DISTRUN_SUMMARY": "0", **extra}


def _launch(tmp_path: Path, rec: Path, *flags: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "distrun", "run", "--nproc-per-node", "2", "--strategy", "ddp",
         *flags, TASK], cwd=tmp_path, env={**os.environ, **_env(rec, **env)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=die_with_parent())


def _wait_for(predicate, what: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before {what}:\n{proc.stdout.read()}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _preempt_after(proc: subprocess.Popen, rec: Path, steps: int,
                   sig: int = signal.SIGTERM, code: int = 143) -> str:
    """``sig`` to the launcher once rank 1 has trained ``steps``: exit ``code``, no abort."""
    try:
        _wait_for(lambda: len(records(str(rec), "steps", 1)) >= steps, f"step {steps}", proc)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == code, out
    assert ABORT not in out, out
    return out


def _manifests(ckpts: Path) -> list[dict]:
    return [json.loads((d / "manifest.json").read_text())
            for d in ckpts.glob("step-*") if (d / "manifest.json").exists()]


def test_kill9_of_the_launcher_ends_every_worker_and_nothing_commits_after(tmp_path,
                                                                          busy_cores):
    pytest.importorskip("distrun_safetensors", reason="checks that no checkpoint commits")
    rec = tmp_path / "rec"
    proc = _launch(tmp_path, rec, "--max-epochs", "100", "--name", "k9",
                   "--ckpt-every-n-steps", "1", LC_SLEEP="0.05")
    try:
        _wait_for(lambda: len(records(str(rec), "steps", 0)) >= 4, "step 4", proc)
        pids = [records(str(rec), "start", r)[0]["pid"] for r in range(2)]
        os.kill(proc.pid, signal.SIGKILL)
        # The launcher is dead once it is reaped, not when the signal is sent: under load it
        # takes a moment to exit, and a worker may rightly commit in that moment.
        proc.wait()
        killed_at = time.time()
        start = time.monotonic()
        while any(pid_alive(p) for p in pids) and time.monotonic() - start < 30:
            time.sleep(0.01)
        gone_after = time.monotonic() - start
    finally:
        proc.kill()
        proc.wait()
    assert not any(pid_alive(p) for p in pids), "workers outlived their launcher by 30 s"
    # the parent-death signal is sent by the kernel as the launcher exits
    assert gone_after < 1.0, f"workers outlived their launcher by {gone_after:.2f} s"
    manifests = _manifests(tmp_path / "runs" / "k9" / "checkpoints")
    assert manifests, "no checkpoint was committed while the launcher lived"
    # committed_at is stamped before the commit checks that its launcher lives, so a stamp
    # after the launcher's death means a commit went ahead after it
    late = [m["step"] for m in manifests if m["committed_at"] > killed_at]
    assert not late, f"checkpoints of steps {late} were committed after the launcher died"


def test_sigterm_to_the_launcher_saves_that_step_and_resume_trains_each_step_once(tmp_path,
                                                                                 busy_cores):
    pytest.importorskip("distrun_safetensors", reason="the preemption checkpoint")
    rec = tmp_path / "rec"
    flags = ("--max-epochs", "2", "--batch-size", "16", "--name", "pre", "--log-every-n-steps",
             "50", "--resume", "auto")
    out = _preempt_after(_launch(tmp_path, rec, *flags, LC_SLEEP="0.05"), rec, steps=5)
    last = [records(str(rec), "steps", r)[-1]["step"] for r in range(2)]
    assert last[0] == last[1], f"the ranks stopped after different steps: {last}\n{out}"
    ckpts = tmp_path / "runs" / "pre" / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == f"step-{last[0]}"

    again = run_cli("run", "--nproc-per-node", "2", "--strategy", "ddp", *flags, TASK,
                    cwd=tmp_path, env=_env(rec), timeout=300)
    assert again.returncode == 0, again
    assert ABORT not in again.output
    for rank in range(2):
        steps = [r["step"] for r in records(str(rec), "steps", rank)]
        # 256 samples / 16 a step, 2 epochs: every step once across the two launches
        assert steps == list(range(1, 33)), (rank, steps)


def test_ctrl_c_saves_the_step_and_exits_130(tmp_path, busy_cores):
    pytest.importorskip("distrun_safetensors", reason="the stop checkpoint")
    rec = tmp_path / "rec"
    proc = _launch(tmp_path, rec, "--max-epochs", "2", "--batch-size", "16", "--name", "cc",
                   LC_SLEEP="0.05")
    out = _preempt_after(proc, rec, steps=5, sig=signal.SIGINT, code=130)
    last = [records(str(rec), "steps", r)[-1]["step"] for r in range(2)]
    assert last[0] == last[1], (last, out)
    latest = tmp_path / "runs" / "cc" / "checkpoints" / "latest"
    assert latest.read_text().strip() == f"step-{last[0]}", out


def test_sigterm_under_join_stops_every_rank_after_the_same_step(tmp_path, busy_cores):
    pytest.importorskip("distrun_join", reason="uneven per-rank data needs distrun-join")
    pytest.importorskip("distrun_safetensors", reason="the preemption checkpoint")
    rec = tmp_path / "rec"
    # rank 0 has 12 batches, rank 1 16: from step 13 on rank 0 has joined and only shadows
    out = _preempt_after(_launch(tmp_path, rec, "--max-epochs", "3", "--name", "jp",
                                 "--join-mode", "join", LC_UNEVEN="1", LC_SLEEP="0.1"),
                         rec, steps=13)
    stopped = records(str(rec), "steps", 1)[-1]["step"]
    assert stopped < 48, "the run trained to the end: the stop was not honoured"
    ckpts = tmp_path / "runs" / "jp" / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == f"step-{stopped}", out


def test_an_early_stop_request_under_join_ends_the_run_normally(tmp_path, busy_cores):
    pytest.importorskip("distrun_join", reason="uneven per-rank data needs distrun-join")
    rec = tmp_path / "rec"
    result = run_cli("run", "--nproc-per-node", "2", "--strategy", "ddp", "--max-epochs", "3",
                     "--join-mode", "join", "--name", "es", TASK, cwd=tmp_path,
                     env=_env(rec, LC_UNEVEN="1", LC_STOP_AT="14@1"), timeout=300)
    assert result.returncode == 0, result
    assert ABORT not in result.output
    # asked after step 14 of rank 1's 16 (rank 0 had joined at 12): agreed at the next vote,
    # at the latest the one that ends the epoch, so the second epoch never starts
    assert 15 <= records(str(rec), "steps", 1)[-1]["step"] <= 16, result.output


def test_a_user_error_on_one_rank_exits_2_with_its_line_and_no_abort(tmp_path, busy_cores):
    rec = tmp_path / "rec"
    result = run_cli("run", "--nproc-per-node", "2", "--strategy", "ddp", "--max-epochs", "3",
                     "--name", "ue", TASK, cwd=tmp_path, env=_env(rec, LC_FAIL_AT="3@1"),
                     timeout=300)
    assert result.returncode == 2, result
    line = "error: rank 1 was told to fail at step 3 (a test)"
    assert result.output.count(line) == 1, result.output
    assert ABORT not in result.output and "Traceback" not in result.output, result.output




@pytest.mark.slow
@pytest.mark.parametrize("launches", [3, pytest.param(8, marks=pytest.mark.extended)])
def test_a_torchrun_script_that_never_destroys_its_group_exits_0_every_time(tmp_path,
                                                                           busy_cores,
                                                                           launches):
    script = tmp_path / "never_destroys.py"
    script.write_text(NEVER_DESTROYS)
    codes = []
    for _ in range(launches):
        result = run_cli("run", "--nproc-per-node", "2", str(script), cwd=tmp_path,
                         env={"OMP_NUM_THREADS": "1"}, timeout=120)
        codes.append(result.returncode)
        assert ABORT not in result.output, result.output
        assert "done 0" in result.stdout and "done 1" in result.stdout, result
    assert codes == [0] * launches
