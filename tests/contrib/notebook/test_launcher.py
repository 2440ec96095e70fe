"""distrun-notebook without a kernel: the launcher forks this pytest process as it would a kernel.

Real forks, real gloo groups, real signals; processes are checked with psutil (or /proc).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch  # imported here as a notebook would: the forked ranks inherit it

import distrun
from distrun._launch.lifeline import die_with_parent
from distrun.testing import imports_torch
from distrun.testing.sockets import listeners_of_held_run
from distrun_notebook import FitResult, LaunchFailed, notebook_launcher

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nb_procs import descendants, read_pids, survivors  # noqa: E402

TINY = Path(__file__).resolve().parents[2] / "core" / "tiny_task.py"


def _write_pid(folder: str, name: str, pid: int | None = None) -> None:
    path = Path(folder) / f"{name}.pid"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(pid or os.getpid()))
    tmp.replace(path)


def _rank_one_raises(folder: str) -> None:
    """Rank 0 starts a grandchild and sleeps (no collective to fail); rank 1 raises."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    _write_pid(folder, f"rank{rank}")
    if rank == 0:
        sleeper = subprocess.Popen(["sleep", "120"])
        _write_pid(folder, "grandchild", sleeper.pid)
        time.sleep(120)
    read_pids(Path(folder), 3)
    raise ValueError(f"boom at rank {rank}")


def test_a_failing_rank_stops_the_others_and_names_itself(tmp_path, busy_cores):
    before = set(descendants())
    started = time.monotonic()
    with pytest.raises(LaunchFailed) as info:
        notebook_launcher(_rank_one_raises, args=(str(tmp_path),), num_processes=2)
    elapsed = time.monotonic() - started
    err = info.value
    assert err.rank == 1 and err.exitcode == 1
    assert str(err).startswith("rank 1 failed: ValueError: boom at rank 1\n")
    # the child's own traceback, with the line that raised
    assert 'in _rank_one_raises\n    raise ValueError(f"boom at rank {rank}")' in str(err)
    assert err.child_traceback.endswith("ValueError: boom at rank 1")
    # rank 0 was asleep for 120 s and its grandchild too: both were stopped, promptly
    assert elapsed < 15, elapsed
    pids = read_pids(tmp_path, 3)
    assert survivors(pids.values()) == []
    assert set(descendants()) <= before


def _returns_env(tag: str) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    print(f"out of rank {dist.get_rank()}")
    print(f"err of rank {dist.get_rank()}", file=sys.stderr)
    dist.destroy_process_group()
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
            "OMP_NUM_THREADS", "TORCHELASTIC_RUN_ID")
    return {"tag": tag, "sum": t.item(), "env": {k: os.environ.get(k) for k in keys},
            "threads": torch.get_num_threads()}


@pytest.mark.slow
def test_rank_zero_value_env_and_output(capfd):
    environ = dict(os.environ)
    result = notebook_launcher(_returns_env, args=("t",), num_processes=3)
    assert result["tag"] == "t" and result["sum"] == 6.0  # 1 + 2 + 3 over three ranks
    env = result["env"]
    assert env["RANK"] == env["LOCAL_RANK"] == "0"
    assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "3"
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["TORCHELASTIC_RUN_ID"]
    assert env["OMP_NUM_THREADS"] == os.environ.get("OMP_NUM_THREADS", "1")
    out, err = capfd.readouterr()
    assert "out of rank 0" in out and "rank 1" not in out and "rank 2" not in out
    assert "err of rank 0" in err and "[rank 1] err of rank 1" in err
    assert dict(os.environ) == environ  # the ranks' variables stay in the ranks


def _sleeps(folder: str) -> None:
    _write_pid(folder, f"rank{os.environ['RANK']}")
    while True:
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize("when", ["running", "starting"])
def test_keyboard_interrupt_stops_every_rank(tmp_path, busy_cores, when):
    before = set(descendants())

    def interrupt() -> None:
        if when == "running":
            read_pids(tmp_path, 4)
        else:  # while the ranks are being forked, or even before
            time.sleep(0.002)
        os.kill(os.getpid(), signal.SIGINT)  # what Jupyter's interrupt does to the kernel

    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        threading.Thread(target=interrupt, daemon=True).start()
        notebook_launcher(_sleeps, args=(str(tmp_path),), num_processes=4)
        time.sleep(5)  # (a SIGINT that came after the call would land here)
    assert time.monotonic() - started < 20
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert survivors(pids) == []
    assert set(descendants()) <= before


def _killed_by_signal() -> None:
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def _exits_with_usage_error() -> None:
    raise distrun.UsageError("bad flag on purpose")


def _nested() -> None:
    notebook_launcher(print, num_processes=1)


def _unpicklable():
    return lambda: None


@pytest.mark.slow
@pytest.mark.parametrize(("fn", "expected"), [
    (_killed_by_signal, r"rank 1 was killed by SIGKILL$"),
    # every rank raises: the one noticed first is named, the other one after it
    (_exits_with_usage_error, r"rank [01] failed: UsageError: bad flag on purpose\n"),
    (_nested, r"rank [01] failed: UsageError: notebook_launcher was called inside a "
              r"process it launched"),
    (_unpicklable, r"rank 0 failed: its return value \(function\) cannot be pickled"),
])
def test_other_failures(fn, expected):
    before = set(descendants())
    with pytest.raises(LaunchFailed) as info:
        notebook_launcher(fn, num_processes=2)
    assert re.match(expected, str(info.value)), str(info.value)
    assert set(descendants()) <= before


def _sys_exit(code):
    print("leaving", file=sys.stderr)
    sys.exit(code)


@pytest.mark.slow
def test_sys_exit_codes():
    assert notebook_launcher(_sys_exit, args=(0,), num_processes=1) is None
    with pytest.raises(LaunchFailed) as info:
        notebook_launcher(_sys_exit, args=(3,), num_processes=1)
    assert str(info.value).startswith("rank 0 exited with code 3: leaving")


@pytest.mark.slow
def test_task_class_on_one_forked_process(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sys.path.insert(0, str(TINY.parent))
    from tiny_task import TinyTask

    first = notebook_launcher(TinyTask, num_processes=1, max_epochs=2, batch_size=32,
                              summary=False)
    second = notebook_launcher(TinyTask(), num_processes=1, max_steps=3, summary=False)
    assert isinstance(first, FitResult)
    assert first.step == 16 and first.epoch == 2  # 256 samples / 32, two epochs done
    assert set(first.metrics) >= {"loss", "lr", "val_loss"}
    # every launch gets a fresh folder, as `distrun run` gives one
    assert first.run_dir == str(tmp_path / "runs" / "notebook")
    assert second.run_dir == str(tmp_path / "runs" / "notebook-2") and second.step == 3
    assert (tmp_path / "runs" / "notebook" / "metrics.csv").exists()


@pytest.mark.slow
def test_a_task_failing_on_one_rank_under_ddp(tmp_path, monkeypatch):
    pytest.importorskip("distrun_ddp", reason="needs the ddp strategy (distrun-ddp)")
    monkeypatch.chdir(tmp_path)
    sys.path.insert(0, str(TINY.parent))
    from tiny_task import TinyTask

    class Breaks(TinyTask):
        def training_step(self, model, batch):
            if os.environ["RANK"] == "1" and self.calls == 4:
                raise RuntimeError("rank one breaks")
            return super().training_step(model, batch)

    before = set(descendants())
    started = time.monotonic()
    with pytest.raises(LaunchFailed) as info:
        notebook_launcher(Breaks, num_processes=2, strategy="ddp", max_epochs=100,
                          summary=False, timeout=300)
    # named, with its traceback through the loop; rank 0 did not wait out the 300 s timeout
    assert str(info.value).startswith("rank 1 failed: RuntimeError: rank one breaks\n")
    assert "in training_step\n" in info.value.child_traceback
    assert time.monotonic() - started < 60
    assert set(descendants()) <= before


def _prints_everywhere() -> None:
    print(f"stdout of rank {os.environ['RANK']}")


@pytest.mark.slow
def test_show_all_ranks(capfd):
    notebook_launcher(_prints_everywhere, num_processes=2, show_all_ranks=True)
    out = capfd.readouterr().out
    assert "stdout of rank 0\n" in out and "[rank 1] stdout of rank 1\n" in out


def _chatty(lines: int) -> int:
    stream = sys.stdout if os.environ["RANK"] == "0" else sys.stderr
    for i in range(lines):
        print(f"line {i}", file=stream)
    return lines


@pytest.mark.slow
def test_a_lot_of_output_arrives_whole_and_in_order(capfd):
    assert notebook_launcher(_chatty, args=(50_000,), num_processes=2) == 50_000
    out, err = capfd.readouterr()
    assert out.splitlines() == [f"line {i}" for i in range(50_000)]
    assert err.splitlines() == [f"[rank 1] line {i}" for i in range(50_000)]


KERNEL_SCRIPT = """
import os, sys, time
sys.path.insert(0, {here!r})
from test_launcher import _sleeps
from distrun_notebook import notebook_launcher
notebook_launcher(_sleeps, args=({folder!r},), num_processes=2)
"""


@pytest.mark.slow
def test_ranks_die_with_the_kernel(tmp_path):
    """A kernel killed outright (kill -9, a crash, "restart kernel") takes its ranks along."""
    script = KERNEL_SCRIPT.format(here=str(Path(__file__).resolve().parent), folder=str(tmp_path))
    kernel = subprocess.Popen([sys.executable, "-c", script], preexec_fn=die_with_parent())
    try:
        pids = read_pids(tmp_path, 2)
        kernel.kill()
        kernel.wait()
        assert survivors(pids.values()) == []
    finally:
        kernel.kill()


#: a kernel whose two ranks form a gloo group, then hold until the test has listed the sockets
HOLDING_KERNEL = """
import os, sys, time
import torch
from distrun_notebook import notebook_launcher


def hold(folder):
    import torch.distributed as dist

    dist.init_process_group()
    total = torch.ones(1)
    dist.all_reduce(total)
    open(os.path.join(folder, "ready%d" % dist.get_rank()), "w").close()
    while not os.path.exists(os.path.join(folder, "go")):
        time.sleep(0.05)
    dist.destroy_process_group()
    return total.item()


print("sum", notebook_launcher(hold, args=(sys.argv[1],), num_processes=2))
"""


@pytest.mark.slow
def test_the_ranks_listen_on_loopback_only(tmp_path):
    """Rank 0's store (on the kernel's loopback socket) and gloo's: none on every interface."""
    (tmp_path / "kernel.py").write_text(HOLDING_KERNEL)
    hold = tmp_path / "hold"
    hold.mkdir()
    listeners, code, output = listeners_of_held_run(
        [sys.executable, "kernel.py", str(hold)], hold, 2, cwd=tmp_path)
    assert code == 0 and "sum 2.0" in output, output
    assert len({s.pid for s in listeners}) >= 2, "\n".join(map(str, listeners))
    assert all(s.loopback for s in listeners), "\n".join(map(str, listeners))


# -- refusals: one line, nothing forked --------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_num_processes(bad):
    with pytest.raises(distrun.UsageError, match=r"^num_processes must be a whole number >= 1"):
        notebook_launcher(print, num_processes=bad)


def test_refusals_name_the_fix():
    sys.path.insert(0, str(TINY.parent))
    from tiny_task import TinyTask

    cases = [
        (dict(fn_or_task=print, max_epochs=2), "max_epochs=: run options apply when launching "
                                               "a Task"),
        (dict(fn_or_task=TinyTask(), args=(1,)), "args are the constructor arguments"),
        (dict(fn_or_task=TinyTask, nproc_per_node=2), "nproc_per_node= is not a "
                                                      "notebook_launcher option: use "
                                                      "num_processes=N"),
        (dict(fn_or_task=TinyTask, max_epoch=2), "max_epoch"),
        (dict(fn_or_task=TinyTask, strategy="dpp"), "unknown strategy 'dpp'"),
        (dict(fn_or_task=42), "runs a function or a distrun Task, got int"),
        (dict(fn_or_task=print, args=5), "args must be a tuple"),
    ]
    before = set(descendants())
    for kwargs, message in cases:
        with pytest.raises(distrun.UsageError) as info:
            notebook_launcher(**kwargs)
        assert message in str(info.value)
        assert "\n" not in str(info.value)
    assert set(descendants()) <= before


def test_refused_while_a_process_group_exists():
    import torch.distributed as dist

    from distrun._launch.ports import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        with pytest.raises(distrun.UsageError, match="a torch.distributed process group "
                                                     "exists in this kernel"):
            notebook_launcher(print, num_processes=2)
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
def test_refused_once_cuda_is_initialized():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    code = ("import torch, distrun\n"
            "from distrun_notebook import notebook_launcher\n"
            "torch.zeros(1, device='cuda')\n"
            "try:\n    notebook_launcher(print, num_processes=2)\n"
            "except distrun.UsageError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.startswith("CUDA is already initialized in this kernel"), out


def test_import_does_not_import_torch():
    assert not imports_torch("distrun_notebook")
