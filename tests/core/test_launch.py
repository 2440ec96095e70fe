"""`distrun run` as torchrun: environment, targets, exit codes, signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distrun._launch.lifeline import die_with_parent
from distrun.testing import run_cli, small_disk

HERE = Path(__file__).resolve().parent

TORCHRUN_SCRIPT = """
import json, os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank())])
dist.all_reduce(t)
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
        "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID",
        "OMP_NUM_THREADS"]
info = {k: os.environ.get(k) for k in keys}
info["sum"] = t.item()
info["argv"] = sys.argv[1:]
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as fh:
    json.dump(info, fh)
dist.destroy_process_group()
"""


def test_torchrun_script_runs_unchanged_on_two_processes(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(TORCHRUN_SCRIPT)
    result = run_cli("run", "--nproc_per_node", "2", str(script), str(tmp_path), "--lr", "3",
                     cwd=tmp_path)
    assert result.returncode == 0, result
    infos = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, info in enumerate(infos):
        assert info["RANK"] == str(rank) and info["LOCAL_RANK"] == str(rank)
        assert info["ROLE_RANK"] == str(rank)
        assert info["WORLD_SIZE"] == "2" and info["LOCAL_WORLD_SIZE"] == "2"
        assert info["GROUP_RANK"] == "0"
        assert info["MASTER_ADDR"] == "127.0.0.1"
        assert int(info["MASTER_PORT"]) > 0
        assert info["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert info["TORCHELASTIC_RUN_ID"]
        assert info["OMP_NUM_THREADS"] == "1"
        assert info["sum"] == 1.0  # 0 + 1: a real gloo all-reduce between the two
        assert info["argv"] == [str(tmp_path), "--lr", "3"]  # script args pass through
    assert infos[0]["MASTER_PORT"] == infos[1]["MASTER_PORT"]


@pytest.mark.slow
def test_module_target(tmp_path):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "job.py").write_text(TORCHRUN_SCRIPT)
    result = run_cli("run", "--nproc-per-node", "2", "-m", "mypkg.job", str(tmp_path),
                     cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 0, result
    assert json.loads((tmp_path / "rank1.json").read_text())["sum"] == 1.0


@pytest.mark.slow
def test_task_target_trains(tmp_path, tiny_script):
    result = run_cli("run", "--max-steps", "3", "--run-dir", str(tmp_path / "r"),
                     f"{tiny_script}:TinyTask", cwd=tmp_path)
    assert result.returncode == 0, result
    assert "Total params" in result.stdout  # the summary table, printed on rank 0


def test_failing_worker_exit_code_and_last_lines(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['RANK'] == '1':\n"
        "    print('about to fail', flush=True)\n"
        "    sys.exit(7)\n"
        "time.sleep(60)\n"
    )
    start = time.monotonic()
    result = run_cli("run", "--nproc-per-node", "2", str(script), cwd=tmp_path)
    assert result.returncode == 7, result
    assert "rank 1 failed with exit code 7" in result.stderr
    # its output was shown as it came: the report is one line naming the rank; a line on
    # stdout is not an error, so it is named as its last line, not quoted as the reason
    assert "distrun: rank 1 failed with exit code 7 and printed no error (its last line, " \
        "above: about to fail)" in result.stderr.splitlines(), result
    assert time.monotonic() - start < 45  # the sleeping rank was stopped, not waited for


def test_a_rank_killed_by_a_signal_is_said_so(tmp_path):
    (tmp_path / "killed.py").write_text(
        "import os, signal, sys\n"
        "print('working', flush=True)\n"
        "print('a warning on stderr', file=sys.stderr, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n")
    result = run_cli("run", "killed.py", cwd=tmp_path, timeout=60)
    assert result.returncode == 137, result
    assert result.stderr.splitlines()[-1] == (
        "distrun: rank 0 failed with exit code 137 (killed by SIGKILL): a warning on stderr "
        "(its output is above)"), result


def test_a_rank_whose_peer_failed_stops_mid_step_and_names_the_rank_that_failed(tmp_path):
    # The launcher notes that rank 1 failed before it stops rank 0: rank 0 does not work
    # through the step it cannot finish (nor is it killed after the grace with no word); it
    # ends at once, through its error path, with one line naming the rank that failed.
    result = run_cli("run", "--nproc-per-node", "2", "--batch-size", "8", "--max-steps", "6",
                     "--no-summary", f"{HERE / 'midstep_task.py'}:MidStep", cwd=tmp_path,
                     timeout=120)
    assert result.returncode != 0, result
    assert "error: rank 0: stopped at step 2 because rank 1 failed with exit code 137 " \
        "(killed by SIGKILL)" in result.stderr.splitlines(), result.stderr
    assert not (tmp_path / "rank0-finished-its-step").exists()


def test_tee_prefixes_ranks(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text("import os\nprint('hello from', os.environ['RANK'])\n")
    result = run_cli("run", "--nproc-per-node", "2", "--tee", str(script), cwd=tmp_path)
    assert result.returncode == 0, result
    assert "[rank0]: hello from 0" in result.stdout
    assert "[rank1]: hello from 1" in result.stdout


CHATTY = """import os, sys
rank = os.environ["RANK"]
for i in range(4000):  # ~240 KB a rank, a line at a time: far more than the disk and a pipe hold
    print(f"rank {rank} line {i:05d} " + "x" * 40)
    if i % 500 == 0:
        print(f"rank {rank} err {i}", file=sys.stderr)
print(f"rank {rank} done", flush=True)
"""


@pytest.mark.slow
def test_a_full_disk_for_the_logs_is_one_warning_and_the_terminal_keeps_everything(tmp_path):
    """``--log-dir`` on a 64 KiB disk: the relay gives the log files up with one warning (the
    same for both ranks), never blocks a worker on its pipe, and every line reaches the
    terminal; the run ends as it would have (before: an ENOSPC traceback per relay thread,
    then the run failed or hung on full pipes)."""
    (tmp_path / "chatty.py").write_text(CHATTY)
    with small_disk(tmp_path / "disk", "64k") as disk:
        result = run_cli("run", "--nproc-per-node", "2", "--log-dir", str(disk / "logs"),
                         "chatty.py", cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result
    out = result.stdout.splitlines()
    for rank in range(2):
        assert [ln for ln in out if ln.startswith(f"rank {rank} line")] == \
            [f"rank {rank} line {i:05d} " + "x" * 40 for i in range(4000)]
        assert f"rank {rank} done" in out
    warnings = [ln for ln in result.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and "No space left on device" in warnings[0], result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert sorted(ln for ln in result.stderr.splitlines() if " err " in ln) == sorted(
        f"rank {r} err {i}" for r in range(2) for i in range(0, 4000, 500))


def test_sigterm_reaches_every_worker(tmp_path, busy_cores):
    script = tmp_path / "wait.py"
    script.write_text(
        "import os, signal, sys, time, pathlib\n"
        "d = pathlib.Path(sys.argv[1])\n"
        "def bye(signum, frame):\n"
        "    (d / f\"stopped{os.environ['RANK']}\").write_text(str(signum))\n"
        "    sys.exit(143)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "(d / f\"ready{os.environ['RANK']}\").write_text('')\n"
        "time.sleep(120)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "distrun", "run", "--nproc-per-node", "2",
                             str(script), str(tmp_path)], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=die_with_parent())
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready{r}").exists() for r in range(2)):
        assert time.monotonic() < deadline, "workers did not start"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, (out, err)
    for r in range(2):
        assert (tmp_path / f"stopped{r}").read_text() == str(int(signal.SIGTERM))


@pytest.mark.slow
def test_two_static_nodes_on_one_machine(tmp_path):
    """--nnodes 2: two launchers (node ranks 0 and 1) form one 4-process group."""
    from distrun.testing import free_port

    script = tmp_path / "plain.py"
    script.write_text(TORCHRUN_SCRIPT)
    port = str(free_port())
    common = [sys.executable, "-m", "distrun", "run", "--nnodes", "2", "--nproc-per-node", "2",
              "--master-addr", "127.0.0.1", "--master-port", port]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([*common, "--node-rank", str(n), str(script), str(tmp_path)],
                              env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, preexec_fn=die_with_parent())
             for n in (0, 1)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, (out, err)
    infos = [json.loads(Path(tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [i["sum"] for i in infos] == [6.0] * 4
    assert [i["GROUP_RANK"] for i in infos] == ["0", "0", "1", "1"]
    assert [i["LOCAL_RANK"] for i in infos] == ["0", "1", "0", "1"]
