"""Habits of real torchrun scripts, run under `distrun run` and under `python -m
torch.distributed.run`: each case asserts that a user sees the same thing under both (issue 36).

One case per habit: a chdir next to the script, the script's own ``sys.excepthook`` and torch's
``[rankN]:`` traceback prefix, a tqdm bar redrawn in place on a terminal, argparse flags named
like launcher options, ``if __name__ == "__main__"`` with ``torch.multiprocessing`` inside a
rank, hydra-style working-folder changes.
"""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from distrun.testing import die_with_parent, run_cli

pytestmark = pytest.mark.slow

#: the two launchers, as a user types them (after `python -m`)
LAUNCHERS = {
    "distrun": ["distrun", "run"],
    "torchrun": ["torch.distributed.run"],
}


def _launch(which: str, args: list[str], cwd: Path, timeout: float = 120) -> tuple[int, str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if which == "distrun":
        result = run_cli("run", *args, cwd=cwd, env=env, timeout=timeout)
        return result.returncode, result.stdout, result.stderr
    # torchrun's ranks share its stdout: under CI's PYTHONUNBUFFERED a print() is two writes (the
    # text, then its newline), and two ranks printing at once could join their lines. Buffered,
    # print(flush=True) is one write. (distrun pipes each rank on its own; it sets the variable.)
    env.pop("PYTHONUNBUFFERED", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=die_with_parent())
    return proc.returncode, proc.stdout, proc.stderr


def _both(args: list[str], cwd: Path) -> dict[str, tuple[int, str, str]]:
    return {which: _launch(which, args, cwd) for which in LAUNCHERS}


def _lines(text: str) -> list[str]:
    return sorted(ln for ln in text.splitlines() if ln.strip())


CHDIR = """import os, sys
os.chdir(os.path.dirname(__file__))
print("cwd", os.getcwd())
print("file", __file__)
print("argv0", sys.argv[0])
print("path0", sys.path[0])
print("spec", __spec__)
print("name", __name__)
print("data", open("data.txt").read().strip())
"""


def test_a_script_that_changes_to_its_own_folder(tmp_path):
    """``os.chdir(os.path.dirname(__file__))`` and what ``python script.py`` gives: an absolute
    ``__file__``, ``sys.argv[0]`` as typed, the script's folder first on ``sys.path``."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text(CHDIR)
    (code / "data.txt").write_text("next to the script\n")
    seen = _both(["code/train.py"], tmp_path)
    for which, (rc, out, err) in seen.items():
        assert rc == 0, (which, err)
        assert _lines(out) == sorted([
            f"cwd {code}", f"file {code / 'train.py'}", "argv0 code/train.py", f"path0 {code}",
            "spec None", "name __main__", "data next to the script"]), (which, out)


HOOK = """import sys
def hook(kind, value, tb):
    print("HOOK CALLED", kind.__name__, value, flush=True)
sys.excepthook = hook
raise ValueError("from the script")
"""
# rank 0 waits outside any collective: which rank failed first is then not a race between
# rank 1's error and rank 0's "connection closed" (both launchers stop rank 0 by a signal)
RANKED = """import time
import torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    raise ValueError("rank one fails")
time.sleep(120)
"""


def test_the_script_s_excepthook_handles_its_error(tmp_path):
    (tmp_path / "hook.py").write_text(HOOK)
    seen = _both(["hook.py"], tmp_path)
    for which, (rc, out, err) in seen.items():
        assert rc == 1, (which, out, err)
        assert "HOOK CALLED ValueError from the script" in out.splitlines(), (which, out)
        # the hook replaced the default report (torchrun adds a traceback of its own)
        assert "ValueError: from the script" not in err, (which, err)


def test_torch_s_rank_prefix_marks_the_failing_rank_s_traceback(tmp_path):
    (tmp_path / "ranked.py").write_text(RANKED)
    seen = _both(["--nproc-per-node", "2", "ranked.py"], tmp_path)
    for which, (rc, _out, err) in seen.items():
        assert rc == 1, (which, err)
        assert "[rank1]: ValueError: rank one fails" in err.splitlines(), (which, err)
        assert "[rank1]: Traceback (most recent call last):" in err.splitlines(), (which, err)
    # distrun's one line names the rank, without torch's prefix in its quote
    assert "distrun: rank 1 failed with exit code 1: ValueError: rank one fails" \
        in seen["distrun"][2], seen["distrun"][2]


def test_an_interrupt_shows_the_script_s_frames_only(tmp_path):
    """Ctrl-C inside the script (its KeyboardInterrupt) is reported as Python reports it: the
    script's frames, none of the launcher's wrapper."""
    (tmp_path / "interrupted.py").write_text("def work():\n    raise KeyboardInterrupt\nwork()\n")
    seen = _both(["interrupted.py"], tmp_path)
    for which, (rc, _out, err) in seen.items():
        assert rc != 0, (which, err)
        assert f'File "{tmp_path / "interrupted.py"}", line 2, in work' in err, (which, err)
        assert "distrun/_train" not in err and "runpy" not in err.split("KeyboardInterrupt")[0] \
            or which == "torchrun", (which, err)
    assert seen["distrun"][0] == 130, seen["distrun"]


BAR = """import os, sys, time
from tqdm import tqdm
go = sys.argv[1]
bar = tqdm(total=3, bar_format="{n}/{total}", mininterval=0, file=sys.stderr)
for i in range(3):
    if i == 1:  # the test has seen 1/3 on its terminal before the script goes on
        deadline = time.monotonic() + 60
        while not os.path.exists(go) and time.monotonic() < deadline:
            time.sleep(0.02)
    bar.update(1)
bar.close()
print("done", file=sys.stderr, flush=True)  # the bar's stream: stdout is another pipe
"""


def _on_a_terminal(cmd: list[str], cwd: Path, go: Path, timeout: float = 120) -> bytes:
    """Run ``cmd`` with a pseudo-terminal as stdout and stderr; what the terminal received.
    Once it shows ``1/3`` the file ``go`` is made (the script waits for it)."""
    master, slave = pty.openpty()
    # a terminal of 24 x 80 (a new pty is 0 x 0, and tqdm draws nothing 0 columns wide)
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "80"}
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=slave,
                            stderr=slave, preexec_fn=die_with_parent(), close_fds=True)
    os.close(slave)
    seen, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # EIO: every writer closed the terminal
                    break
                if not chunk:
                    break
                seen += chunk
                if b"1/3" in seen and not go.exists():
                    go.touch()
            elif proc.poll() is not None and not ready:
                break
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return seen


def test_a_progress_bar_redraws_in_place_on_a_terminal(tmp_path):
    """tqdm's ``\\r`` redraws reach the terminal as written and as they happen (the script
    waits until the terminal has shown ``1/3``), the same bytes as under torchrun."""
    pytest.importorskip("tqdm")
    (tmp_path / "bar.py").write_text(BAR)
    screens = {}
    for which, head in LAUNCHERS.items():
        go = tmp_path / f"go-{which}"
        cmd = [sys.executable, "-m", *head, *(["--standalone"] if which == "torchrun" else []),
               "bar.py", str(go)]
        screens[which] = _on_a_terminal(cmd, tmp_path, go)
        assert go.exists(), (which, screens[which])  # 1/3 was shown while the script ran
    bars = {}
    for which, screen in screens.items():
        start = screen.index(b"0/3")
        bars[which] = screen[start:screen.index(b"\n", start)].rstrip(b"\r")
        # redrawn in place: one line for the whole bar, each state after a carriage return
        assert b"0/3\r1/3\r2/3\r3/3" in bars[which], (which, screen)
        assert b"done" in screen, (which, screen)
    assert bars["distrun"] == bars["torchrun"], bars


FLAGS = """import argparse
p = argparse.ArgumentParser()
p.add_argument("--backend", default="nccl")
p.add_argument("--nproc-per-node", type=int, default=1)
p.add_argument("--max-restarts", type=int, default=0)
a = p.parse_args()
print("script", a.backend, a.nproc_per_node, a.max_restarts)
"""


def test_argparse_flags_named_like_launcher_options_stay_the_script_s(tmp_path):
    (tmp_path / "flags.py").write_text(FLAGS)
    seen = _both(["flags.py", "--backend=gloo", "--nproc-per-node", "4", "--max-restarts", "2"],
                 tmp_path)
    for which, (rc, out, err) in seen.items():
        assert rc == 0, (which, err)
        assert _lines(out) == ["script gloo 4 2"], (which, out)
    assert seen["distrun"][2] == "", seen["distrun"]  # no warning: the script reads them


# The two children of a rank share its stdout, and under PYTHONUNBUFFERED (as CI runs) print()
# writes the text and its newline in two calls: two children printing at once can join their
# lines ("...child 1 of __mp_main__rank 1 child 0..."), under torchrun as under distrun. Each
# child writes its line with its newline in one call (one write(2) below PIPE_BUF is atomic).
SPAWN = """import os, sys
import torch.multiprocessing as mp

def child(i, rank):
    sys.stdout.write(f"rank {rank} child {i} of {__name__}\\n")
    sys.stdout.flush()

if __name__ == "__main__":
    rank = int(os.environ["RANK"])
    mp.spawn(child, args=(rank,), nprocs=2)
    print(f"rank {rank} main done", flush=True)
"""


def test_torch_multiprocessing_inside_a_rank_behind_a_main_guard(tmp_path):
    (tmp_path / "spawner.py").write_text(SPAWN)
    seen = _both(["--nproc-per-node", "2", "spawner.py"], tmp_path)
    want = sorted([f"rank {r} child {i} of __mp_main__" for r in range(2) for i in range(2)]
                  + [f"rank {r} main done" for r in range(2)])
    for which, (rc, out, err) in seen.items():
        assert rc == 0, (which, err)
        assert _lines(out) == want, (which, out)


HYDRA = """import os, sys
start = os.getcwd()
out = os.path.join("outputs", "run-" + os.environ["RANK"])
os.makedirs(out, exist_ok=True)
os.chdir(out)  # hydra's job.chdir: the run works in its own output folder
with open("log.txt", "w") as fh:
    fh.write("written\\n")
print("rank", os.environ["RANK"], "started in", start, "now in", os.getcwd(), flush=True)
"""


def test_hydra_style_working_folder_changes(tmp_path):
    (tmp_path / "app.py").write_text(HYDRA)
    for which in LAUNCHERS:
        where = tmp_path / which
        where.mkdir()
        rc, out, err = _launch(which, ["--nproc-per-node", "2", str(tmp_path / "app.py")], where)
        assert rc == 0, (which, err)
        assert _lines(out) == [
            f"rank {r} started in {where} now in {where / 'outputs' / f'run-{r}'}"
            for r in range(2)], (which, out)
        for r in range(2):
            assert (where / "outputs" / f"run-{r}" / "log.txt").read_text() == "written\n"
