"""A run that stops moving is named: the rank the others wait for, its host, what it does
and its line, within ``--stall-timeout`` + 5 s, with every rank's stacks in ``stall-N/``.

Real ``distrun run`` launches of 2-3 gloo ranks; one rank hangs on purpose (a sleep standing
for a deadlock, a read nobody answers, SIGSTOP, a skipped collective). ``distrun stacks``
reads a live run from another process.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distrun.testing import run_cli

HERE = Path(__file__).resolve().parent
HOST = socket.gethostname()
LIMIT = 4  # --stall-timeout of these runs
SLACK = 5.0  # the bound: the summary within the limit plus this


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
            "STALL_MARK": str(tmp_path / "fault"), **extra}


def _stall(result, tmp_path: Path, folder: Path) -> str:
    """The summary line, after checking the exit, the evidence and the delay."""
    assert result.returncode == 1, result
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("error: stall")]
    assert len(lines) == 1, result.stderr
    line = lines[0]
    summary = folder / "summary.txt"
    assert summary.read_text().strip() == line[len("error: "):], line
    fault = float((tmp_path / "fault").read_text())
    took = summary.stat().st_mtime - fault
    assert took <= LIMIT + SLACK, f"{took:.1f} s from the fault to the summary: {line}"
    for rank_file in folder.glob("rank*.txt"):
        assert rank_file.read_text().strip(), rank_file
    return line


def _task_run(tmp_path: Path, part: str, *flags: str, **env: str):
    return run_cli("run", "--nproc-per-node", "2", "--stall-timeout", str(LIMIT),
                   "--timeout", "60", "--name", "s", "--batch-size", "16", *flags,
                   "stall_task:StallTask", cwd=tmp_path, timeout=120,
                   env=_env(tmp_path, STALL_IN=part, **env))


def test_a_rank_stuck_in_its_training_step_is_named_with_its_line(tmp_path):
    result = _task_run(tmp_path, "step")
    line = _stall(result, tmp_path, tmp_path / "runs" / "s" / "stall-1")
    m = re.search(r"stall at step (\d+): rank 1 \(host ([^,]+), pid \d+\) in training_step for "
                  r"\d+ s at stall_task\.py:\d+ \(time\.sleep\(600\)\)", line)
    assert m, line
    assert m.group(1) == "20" and m.group(2) == HOST, line  # its 20th step hangs
    assert "rank 0 in backward" in line, line  # DDP's all-reduce waits in backward
    assert "uneven" not in line, line
    stacks = (tmp_path / "runs" / "s" / "stall-1" / "rank1.txt").read_text()
    assert "in training_step" in stacks and "stall_task.py" in stacks, stacks


def test_a_rank_that_spins_while_the_others_wait_is_said_busy_once_and_the_timeout_ends_it(
        tmp_path):
    # a livelock looks like work: never called a stall (it might finish), but said once
    result = run_cli("run", "--nproc-per-node", "2", "--stall-timeout", str(LIMIT),
                     "--timeout", "15", "--name", "s", "--batch-size", "16",
                     "stall_task:StallTask", cwd=tmp_path, timeout=120,
                     env=_env(tmp_path, STALL_IN="step", STALL_HOW="spin"))
    assert result.returncode == 1, result
    assert "error: stall" not in result.stderr, result.stderr
    busy = [ln for ln in result.stderr.splitlines() if ln.startswith("warning: busy")]
    assert len(busy) == 1, result.stderr
    assert re.search(r"^warning: busy at step 20: rank 1 \(host [^,]+, pid \d+\) in "
                     r"training_step for \d+ s at stall_task\.py:\d+ \(.*\); rank 0 in backward "
                     r"for \d+ s \(rank 1 burns CPU while the others wait: a livelock, or work "
                     r"longer than they wait \(the collective timeout, 15 s, ends the run unless "
                     r"it finishes\)\); stacks: runs/s/busy-1/$", busy[0]), busy
    folder = tmp_path / "runs" / "s" / "busy-1"
    took = (folder / "summary.txt").stat().st_mtime - float((tmp_path / "fault").read_text())
    assert took <= LIMIT + SLACK, took
    assert "stall_task.py" in (folder / "rank1.txt").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "pp", "tp", "rpc",
                                      pytest.param("deepspeed", marks=pytest.mark.extended)])
def test_a_rank_stuck_under_another_strategy_is_named_the_same_way(tmp_path, strategy):
    """rpc: trainers 0 and 1, and rank 2 serves them (it takes no steps, so it is never the
    one behind; TensorPipe's polling thread does not make the waiting ranks look busy)."""
    if strategy == "deepspeed":
        pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    flags = ["--strategy", strategy]
    if strategy == "rpc":
        flags = [*flags, "--nproc-per-node", "3"]
    result = _task_run(tmp_path, "step", *flags)
    line = _stall(result, tmp_path, tmp_path / "runs" / "s" / "stall-1")
    m = re.search(r"stall at step (\d+): rank 1 \(host [^,]+, pid \d+\) in training_step for "
                  r"\d+ s at stall_task\.py:\d+ \(time\.sleep\(600\)\); rank 0 ", line)
    assert m, line
    # (pp calls training_step once per micro-batch: its 20th call is in step 3)
    assert m.group(1) == ("3" if strategy == "pp" else "20"), line
    if strategy == "rpc":
        assert re.search(r"; rank 2 serving the trainers \(takes no steps\) for \d+ s;", line), line


@pytest.mark.slow
@pytest.mark.parametrize(("part", "phase"), [
    ("data", "loading data"), ("validation", "in validation"),
    ("checkpoint", "saving a checkpoint")])
def test_a_rank_stuck_elsewhere_in_the_step_is_named_with_the_phase(tmp_path, part, phase):
    flags = {"data": (), "validation": ("--val-every-n-steps", "5"),
             "checkpoint": ("--ckpt-every-n-steps", "5")}[part]
    result = _task_run(tmp_path, part, *flags, STALL_AT={"data": "400", "validation": "5", "checkpoint": "2"}[part],
                       DISTRUN_DISABLE_PLUGIN_AUTOLOAD="1",
                       DISTRUN_PLUGINS="distrun_ddp.plugin,distrun_safetensors.plugin,"
                                       "stall_plugin")
    line = _stall(result, tmp_path, tmp_path / "runs" / "s" / "stall-1")
    assert re.search(rf": rank 1 \(host {re.escape(HOST)}, pid \d+\) {phase} for \d+ s at "
                     r"stall_(task|plugin)\.py:\d+ \(time\.sleep\(600\)\)", line), line


def _script_run(tmp_path: Path, mode: str, nproc: int = 2):
    return run_cli("run", "--nproc-per-node", str(nproc), "--stall-timeout", str(LIMIT),
                   "--timeout", "60", str(HERE / "stall_script.py"), cwd=tmp_path, timeout=120,
                   env=_env(tmp_path, STALL_MODE=mode))


def _evidence(result) -> Path:
    m = re.search(r"stacks: (\S+)/$", result.stderr.strip().splitlines()[-1])
    assert m, result.stderr
    return Path(m.group(1))


@pytest.mark.parametrize("mode", ["read", "stop"])
def test_a_plain_script_rank_blocked_in_c_or_stopped_is_named_as_such(tmp_path, mode):
    result = _script_run(tmp_path, mode)
    folder = _evidence(result)
    try:
        line = _stall(result, tmp_path, folder)
    finally:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)  # (a script without a run folder: in /tmp)
    if mode == "read":
        assert re.search(r"rank 1 \(host \S+, pid \d+\) runs the script since collective #\d+ "
                         r"for \d+ s at stall_script\.py:\d+ \(os\.read\(os\.pipe\(\)\[0\], 1\)\)",
                         line), line
    else:
        assert re.search(r"rank 1 \(host \S+, pid \d+\) is stopped \(SIGSTOP", line), line
        assert "rank 1 (host" in line and "waits in" not in line.split(";")[0], line
    assert re.search(r"rank 0 waits in all_reduce #\d+ for \d+ s at stall_script\.py:\d+ "
                     r"\(dist\.all_reduce\(t\)\)", line), line


@pytest.mark.slow
def test_a_rank_that_skipped_a_collective_is_named_by_the_others_sequence(tmp_path):
    result = _script_run(tmp_path, "skip", nproc=3)
    folder = _evidence(result)
    try:
        line = _stall(result, tmp_path, folder)
    finally:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    assert re.search(r"stall after collective #\d+: rank 1 \(host", line), line
    assert re.search(r"different collectives as #\d+ \(ranks 0,2 broadcast, rank 1 all_reduce\)",
                     line), line


def test_a_stall_timeout_not_under_the_timeout_is_refused_in_one_line(tmp_path):
    result = run_cli("run", "--stall-timeout", "60", "--timeout", "60",
                     str(HERE / "stall_script.py"), cwd=tmp_path)
    assert result.returncode == 2, result
    assert result.stderr.strip().splitlines() == [
        "error: --stall-timeout 60 must be shorter than --timeout 60: a collective would fail "
        "first, with no diagnosis (lower --stall-timeout or raise --timeout)"], result.stderr


@pytest.mark.slow
def test_a_stalled_attempt_is_restarted_by_max_restarts_and_the_run_finishes(tmp_path):
    result = _task_run(tmp_path, "step", "--max-restarts", "1", "--max-epochs", "1",
                       STALL_ONCE="1")
    assert result.returncode == 0, result
    assert result.stderr.count("error: stall at step 20: rank 1") == 1, result.stderr
    assert "distrun: the ranks stalled (said above); restarting the workers from the latest " \
        "checkpoint (restart 1 of 1)" in result.stderr, result.stderr
    assert (tmp_path / "runs" / "s" / "stall-1" / "summary.txt").is_file()


@pytest.mark.slow
def test_a_run_that_stalls_at_every_attempt_ends_with_exit_1_and_the_stall_lines(tmp_path):
    result = _task_run(tmp_path, "step", "--max-restarts", "1", "--max-epochs", "1")
    assert result.returncode == 1, result
    assert result.stderr.count("error: stall at step 20: rank 1") == 2, result.stderr
    last = result.stderr.strip().splitlines()[-2:]
    assert last[0].startswith("error: stall at step 20: rank 1") and \
        last[1] == "distrun: no restarts left (1 used)", last  # no report of a killed rank


def test_distrun_stacks_reads_a_live_run_and_says_when_none_is(tmp_path):
    none = run_cli("stacks", str(tmp_path / "runs" / "x"), cwd=tmp_path)
    assert none.returncode == 2, none
    assert none.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'runs' / 'x'} is not a live run on this host (run `distrun stacks` "
        "on a node of a running `distrun run`, with its run folder, e.g. runs/NAME)"], none
    env = {**os.environ, "OMP_NUM_THREADS": "1", **_env(tmp_path, STALL_IN="step",
                                                         STALL_AT="30")}
    run = subprocess.Popen([sys.executable, "-m", "distrun", "run", "--nproc-per-node", "2",
                            "--name", "live", "--batch-size", "16", "stall_task:StallTask"],
                           cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / "fault").exists():
            assert run.poll() is None and time.monotonic() < deadline, run.stderr.read()
            time.sleep(0.2)
        time.sleep(1.0)
        looked = run_cli("stacks", "runs/live", cwd=tmp_path)
    finally:
        run.kill()
        run.wait()
    assert looked.returncode == 0, looked
    assert re.search(r"^positions at step 30: rank 1 \(host \S+, pid \d+\) in training_step "
                     r"for \d+ s at stall_task\.py:\d+ \(time\.sleep\(600\)\); rank 0 in "
                     r"backward for \d+ s; stacks: .*runs/live/stacks-1/$", looked.stdout.strip()), \
        looked.stdout
    assert "in training_step" in (tmp_path / "runs" / "live" / "stacks-1" / "rank1.txt").read_text()
