"""A worker ends its process as ``python`` would (issue 26, item 0): threading's exit callbacks
stop idle pool threads before non-daemon threads are joined, a thread still working after main
returns finishes, and the exit handlers run newest first, all before the exit code is given."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from distrun.testing import run_cli

#: a pool kept alive by a module (as torch.compile's, a tokenizer's or a data loader's is), a
#: thread that does its work after main has returned, two exit handlers, an exit code
EXIT_ORDER = """
import atexit, logging, sys, threading, time
from concurrent.futures import ThreadPoolExecutor

logging.pool = ThreadPoolExecutor(2)
print("pool:", logging.pool.submit(pow, 6, 2).result(), flush=True)
go = threading.Event()

def late_work():
    go.wait()
    time.sleep(0.3)  # main has returned by now
    print("thread: finished after main", flush=True)

threading.Thread(target=late_work).start()
atexit.register(print, "atexit: registered first, runs last")
atexit.register(print, "atexit: registered last, runs first")
print("main: done", flush=True)
go.set()
sys.exit(int(sys.argv[1]))
"""


def test_a_live_thread_pool_exits_and_late_work_and_exit_handlers_run_as_under_python(
        tmp_path):
    (tmp_path / "order.py").write_text(EXIT_ORDER)
    python = subprocess.run([sys.executable, "order.py", "3"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert python.returncode == 3, python.stderr
    assert python.stdout.splitlines() == [
        "pool: 36", "main: done", "thread: finished after main",
        "atexit: registered last, runs first", "atexit: registered first, runs last"]
    ours = run_cli("run", "--nproc-per-node", "1", "order.py", "3", cwd=tmp_path, timeout=60)
    assert ours.returncode == 3, ours
    assert ours.stdout == python.stdout


#: a torchrun script: a group it never destroys, a module-held pool that ran a collective
TORCHRUN_POOL = """
import atexit, logging, os, sys, threading
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])

def say(words):  # one write per line: both ranks share the console
    sys.stdout.write(f"{rank}: {words}\\n")
    sys.stdout.flush()

dist.init_process_group("gloo")
logging.pool = ThreadPoolExecutor(2)
total = torch.tensor([rank + 1.0])
logging.pool.submit(dist.all_reduce, total).result()
say(f"sum {total.item()}")
# torch's own exit with a live process group can abort in C++ ("terminate called without an
# active exception": torchrun's side of this test, once under load): the group goes first,
# the pool and the thread stay alive into the exit
dist.destroy_process_group()
go = threading.Event()
threading.Thread(target=lambda: (go.wait(), say("thread done"))).start()
atexit.register(say, "atexit")
say("main done")
go.set()
"""


def _by_rank(stdout: str) -> dict[str, list[str]]:
    lines: dict[str, list[str]] = {}
    for line in stdout.splitlines():
        rank, _, rest = line.partition(": ")
        lines.setdefault(rank, []).append(rest)
    return lines


@pytest.mark.slow
def test_a_torchrun_script_with_a_live_pool_behaves_as_under_torchrun(tmp_path):
    (tmp_path / "pool.py").write_text(TORCHRUN_POOL)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "pool.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert torchrun.returncode == 0, torchrun.stderr
    expected = ["sum 3.0", "main done", "thread done", "atexit"]
    assert _by_rank(torchrun.stdout) == {"0": expected, "1": expected}, torchrun.stdout
    ours = run_cli("run", "--nproc-per-node", "2", "pool.py", cwd=tmp_path, timeout=180)
    assert ours.returncode == torchrun.returncode, ours
    assert _by_rank(ours.stdout) == _by_rank(torchrun.stdout), ours


@pytest.mark.slow
def test_compiled_ddp_run_of_the_digits_example_ends(tmp_path, compile_cache):
    """torch.compile keeps a thread pool while it compiles: the run used to train, print its
    result and then hang at exit. The session's compile cache (no other test compiles the
    digits model, so its graphs are built here: a warm cache would start no pool). Rank 0 says
    when compiling starts and how long it took; metrics.csv keeps the time as compile_s."""
    pytest.importorskip("distrun_ddp", reason="needs distrun-ddp")
    pytest.importorskip("sklearn", reason="the digits example reads scikit-learn's data")
    digits = Path(__file__).parents[2] / "examples" / "digits.py"
    result = run_cli("run", "--nproc-per-node", "2", "--strategy", "ddp", "--max-epochs", "1",
                     "--compile", "--run-dir", str(tmp_path / "run"), str(digits),
                     cwd=tmp_path, timeout=420, env=compile_cache)
    assert result.returncode == 0, result
    assert "validation accuracy:" in result.stdout, result
    said = [line for line in result.stdout.splitlines() if "torch.compile:" in line]
    assert len(said) == 2, result
    assert "compiling the model" in said[0] and "compiling by the end of the first step" \
        in said[1] and "inductor cache cold" in said[1], said
    with open(tmp_path / "run" / "metrics.csv") as fh:
        header = fh.readline().strip().split(",")
    assert "compile_s" in header, header


#: a worker's exit with torch imported: a handler registered before torch's, so run after
#: them (newest first), says what torch's handlers left behind
TORCH_EXIT = """
import atexit, logging, sys
atexit.register(lambda: print("tabulate imported at exit:", "tabulate" in sys.modules,
                              flush=True))
import torch, torch._dynamo  # (torch's optimizers import dynamo: every worker has)
if sys.argv[1] == "info":
    logging.getLogger("torch._dynamo.utils").setLevel(logging.INFO)
print("tabulate imported:", "tabulate" in sys.modules, flush=True)
"""


@pytest.mark.parametrize("log", ["off", "info"])
def test_torchs_exit_work_that_nothing_outlives_is_skipped_and_a_log_asked_for_kept(tmp_path,
                                                                                   log):
    # torch._dynamo formats its compile times for a log line at INFO at every exit, importing
    # tabulate for it (0.02 s of each worker's exit, a restart's survivors' too): skipped while
    # that log is off, kept when a user turned it on.
    (tmp_path / "exit.py").write_text(TORCH_EXIT)
    ours = run_cli("run", "--nproc-per-node", "1", "exit.py", log, cwd=tmp_path, timeout=120)
    assert ours.returncode == 0, ours
    assert ours.stdout.splitlines() == [
        "tabulate imported: False", f"tabulate imported at exit: {log == 'info'}"], ours
