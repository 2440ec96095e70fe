"""distrun-progress: a rich bar on a terminal (a real pty via `script`), plain lines in a pipe."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from distrun.testing import run_cli

TASK = str(Path(__file__).resolve().parents[2] / "core" / "tiny_task.py")
# tiny_task: 256 samples; --batch-size 32 -> 8 steps per epoch; 2 epochs -> 16 steps.
FLAGS = ("--max-epochs", "2", "--batch-size", "32", "--log-every-n-steps", "4", "--no-summary")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.mark.slow
def test_pipe_gets_periodic_plain_lines(tmp_path):
    result = run_cli("run", "--name", "p", "--progress-interval", "0", *FLAGS, TASK,
                     cwd=tmp_path)
    assert result.returncode == 0, result
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("[progress] epoch")]
    # interval 0: one line per optimizer step, with total, loss, samples/s and ETA.
    assert len(lines) == 16, result.stdout
    assert lines[0].startswith("[progress] epoch 1/2 | step 1/16 (6%) | loss ")
    assert lines[-1].startswith("[progress] epoch 2/2 | step 16/16 (100%) | loss ")
    assert all(re.search(r"\| [0-9.]+ samples/s \|", ln) for ln in lines[1:]), lines
    assert all(re.search(r"ETA \d+:\d\d:\d\d$", ln) for ln in lines[1:]), lines
    assert "val_loss" in lines[-1]  # validation of epoch 1 shows from then on
    assert "[progress] validation at step 8 | val_loss" in result.stdout
    assert not ANSI.search(result.stdout)  # nothing for a terminal in a CI log
    # The progress plugin took over the core's console line.
    assert not re.search(r"^epoch \d \| step", result.stdout, re.M)
    # Rank 0's log file in the run folder has the same lines.
    log = (tmp_path / "runs" / "p" / "logs" / "rank0.log").read_text()
    assert log.count("[progress] epoch") == 16


@pytest.mark.slow
def test_interval_thins_the_lines(tmp_path):
    result = run_cli("run", "--progress-interval", "3600", *FLAGS, TASK, cwd=tmp_path)
    assert result.returncode == 0, result
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("[progress] epoch")]
    # The first step prints at once, then nothing for an hour, then the final line.
    assert [ln.split(" | ")[1] for ln in lines] == ["step 1/16 (6%)", "step 16/16 (100%)"]


@pytest.mark.slow
def test_no_progress_brings_back_the_console_line(tmp_path):
    result = run_cli("run", "--no-progress", *FLAGS, TASK, cwd=tmp_path)
    assert result.returncode == 0, result
    assert "[progress]" not in result.stdout
    steps = re.findall(r"^epoch \d \| step (\d+) \| loss ", result.stdout, re.M)
    assert steps == ["4", "8", "12", "16"], result.stdout


@pytest.mark.skipif(shutil.which("script") is None, reason="needs util-linux `script` for a pty")
@pytest.mark.slow
def test_terminal_gets_a_rich_bar(tmp_path):
    cmd = shlex.join([sys.executable, "-m", "distrun", "run", "--name", "t", *FLAGS, TASK])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "160", "TERM": "xterm"}
    env.pop("DISTRUN_PROGRESS_TTY", None)
    proc = subprocess.run(["script", "-qefc", cmd, "/dev/null"], cwd=tmp_path, env=env,
                          capture_output=True, timeout=300, stdin=subprocess.DEVNULL)
    out = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, out
    assert "\x1b[?25l" in out  # rich hid the cursor: a live display, drawn on the terminal
    frames = [ANSI.sub("", f) for f in re.split(r"\r|\n", out)]
    final = [f for f in frames if "16/16" in f]
    assert final, out
    assert re.search(r"epoch 2/2 .*16/16 .*loss \d+\.\d{4} \| [0-9.]+ samples/s", final[-1])
    assert "[progress]" not in out  # no plain lines when there is a terminal
    # The bar went to the terminal directly; the workers' pipe (and so rank0.log) has no bar.
    assert "16/16" not in (tmp_path / "runs" / "t" / "logs" / "rank0.log").read_text()


@pytest.mark.slow
def test_forced_bar_on_a_pipe(tmp_path):
    result = run_cli("run", "--progress-mode", "bar", *FLAGS, TASK, cwd=tmp_path)
    assert result.returncode == 0, result
    plain = ANSI.sub("", result.stdout)
    assert "\x1b[" in result.stdout
    assert re.search(r"epoch 2/2 .* 16/16 loss \d+\.\d{4} \| [0-9.]+ samples/s ETA", plain), plain
    # Validation results print above the bar, which stays on one 80-column line.
    assert "validation at step 8 | val_loss " in plain


def test_plugin_module_does_not_import_torch_or_rich():
    code = "import sys, distrun_progress.plugin; print('torch' in sys.modules, 'rich' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False"


def test_two_ranks_one_display(tmp_path):
    pytest.importorskip("distrun_ddp", reason="two processes need the ddp strategy")
    result = run_cli("run", "--nproc-per-node", "2", "--strategy", "ddp", "--name", "two",
                     "--progress-interval", "0", "--tee", *FLAGS, TASK, cwd=tmp_path)
    assert result.returncode == 0, result
    lines = [ln for ln in result.stdout.splitlines() if "[progress] epoch" in ln]
    # Rank 0 only; the global batch of 32 is split, so still 8 steps per epoch.
    assert len(lines) == 16 and all(ln.startswith("[rank0]: ") for ln in lines), lines
    assert "[progress]" not in (tmp_path / "runs" / "two" / "logs" / "rank1.log").read_text()


# -- what a user saw go wrong (issue 30, item 7) ---------------------------------------------

FIT_TEST = f"{Path(__file__).resolve().parent / 'fit_test_task.py'}:FitTestTask"
CSI = re.compile(r"\x1b\[([0-9;?]*)([A-Za-z])")


def screen(raw: str) -> list[str]:
    """The lines a terminal shows after ``raw``: text overwrites at the cursor; carriage
    return, line feed, erase-line and cursor-up move or clear as a terminal does; colours
    and cursor visibility are dropped."""
    lines: list[list[str]] = [[]]
    row = col = 0
    i = 0
    while i < len(raw):
        ch = raw[i]
        match = CSI.match(raw, i) if ch == "\x1b" else None
        if match:
            arg, verb = match.groups()
            if verb == "K":  # erase in line: 2 the whole line, 0 (default) to its end
                lines[row] = [] if arg == "2" else lines[row][:col]
            elif verb == "A":
                row = max(0, row - int(arg or 1))
            i = match.end()
            continue
        if ch == "\r":
            col = 0
        elif ch == "\n":
            row += 1
            col = 0
            if row == len(lines):
                lines.append([])
        elif ch >= " ":
            line = lines[row]
            line.extend(" " * (col - len(line)))
            line[col:col + 1] = [ch]
            col += 1
        i += 1
    return ["".join(line).rstrip() for line in lines]


def test_fit_then_test_prints_the_test_result(tmp_path):
    # The progress display owns the console line during the fit only: the test stage after it
    # prints its result (it printed nothing while distrun-progress was installed).
    result = run_cli("run", "--stage", "fit,test", "--progress-interval", "3600", *FLAGS,
                     FIT_TEST, cwd=tmp_path)
    assert result.returncode == 0, result
    assert re.search(r"^step 16 \| test_loss \d+\.\d{4}$", result.stdout, re.M), result.stdout


@pytest.mark.skipif(shutil.which("script") is None, reason="needs util-linux `script` for a pty")
@pytest.mark.slow
def test_terminal_lines_never_share_a_line_with_the_bar(tmp_path):
    # In a real terminal: the model summary (logged as the bar starts) and a print of the task
    # while the bar is drawn are relayed by the launcher onto the terminal the bar draws on.
    # Each must stand on a line of its own, with no frame of the bar left before it.
    flags = [f for f in FLAGS if f != "--no-summary"]
    cmd = shlex.join([sys.executable, "-m", "distrun", "run", "--stage", "fit,test", *flags,
                      FIT_TEST])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "100", "TERM": "xterm",
           "PROGRESS_PRINT_AT": "5"}
    env.pop("DISTRUN_PROGRESS_TTY", None)
    proc = subprocess.run(["script", "-qefc", cmd, "/dev/null"], cwd=tmp_path, env=env,
                          capture_output=True, timeout=300, stdin=subprocess.DEVNULL)
    raw = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, raw
    assert "\x1b[?25l" in raw  # a live bar was drawn on the terminal
    shown = screen(raw)
    text = "\n".join(shown)
    for needle in ("| Name", "Total params", "task says hello at step 5"):
        (line,) = [ln for ln in shown if needle in ln]
        assert "ETA" not in line and "/16" not in line, text  # no stale frame on its line
    assert "task says hello at step 5" in shown, text
    assert [ln for ln in shown if ln.startswith("  | Name")], text
    # The bar's last frame stays, once, and the test result follows it.
    assert len([ln for ln in shown if "16/16" in ln]) == 1, text
    assert re.search(r"^step 16 \| test_loss \d+\.\d{4}$", text, re.M), text


def test_the_launchers_lines_clear_the_bar_line_first():
    import io

    from distrun_progress.shared_terminal import CLEAR_LINE, LineClearing

    out = io.StringIO()
    stream = LineClearing(out)
    out.write("epoch 1/2 ━━ 3/16 ETA 0:00:01")  # the bar's frame, drawn by rank 0
    print("  | Name | Type", file=stream)  # print() writes the text, then "\n"
    stream.write("a\nb\n")
    stream.write("partial ")
    stream.write("line\n")
    assert out.getvalue() == ("epoch 1/2 ━━ 3/16 ETA 0:00:01" + CLEAR_LINE + "  | Name | Type\n"
                              + CLEAR_LINE + "a\nb\n" + CLEAR_LINE + "partial line\n")
    assert screen(out.getvalue()) == ["  | Name | Type", "a", "b", "partial line", ""]


@pytest.mark.skipif(shutil.which("script") is None, reason="needs util-linux `script` for a pty")
@pytest.mark.skipif(importlib.util.find_spec("distrun_tune") is None,
                    reason="a fit without steps comes from distrun-tune's finders")
@pytest.mark.slow
def test_a_fit_without_steps_leaves_no_bar(tmp_path):
    # `distrun tune lr` runs a finder instead of the fit's steps: the bar it started at the
    # fit's start would stay on the terminal as `0/N ... ETA -:--:--`; it is erased instead.
    task = f"{Path(__file__).resolve().parents[1] / 'tune' / 'tune_tasks.py'}:Quadratic"
    cmd = shlex.join([sys.executable, "-m", "distrun", "tune", "lr", "--batch-size", "8",
                      "--tune-steps", "20", "--tune-min-lr", "1e-3", "--no-summary", task])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "100", "TERM": "xterm"}
    env.pop("DISTRUN_PROGRESS_TTY", None)
    proc = subprocess.run(["script", "-qefc", cmd, "/dev/null"], cwd=tmp_path, env=env,
                          capture_output=True, timeout=300, stdin=subprocess.DEVNULL)
    raw = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, raw
    assert "\x1b[?25l" in raw  # the bar was drawn
    shown = [ln for ln in screen(raw) if ln]
    assert shown[-1].startswith("LR range test (single, 1 rank): suggested lr "), shown
    assert not [ln for ln in shown if "ETA" in ln], shown
