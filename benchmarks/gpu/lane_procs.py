"""The GPU lane's process plumbing, shared by lane.py and its subprocess checks.

A child tied to the process that started it (``_tie``), a check's process group ended
(``_kill_group``), the environment every check runs in (``_env``, ``_probe_env``), and what a
subprocess check records and runs with (``Result``, ``_run``). Standard library only.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
PY = sys.executable


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _find_prctl() -> Any:
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: children are only stopped on timeouts
        return None


#: looked up once in the parent: no dlopen between fork and exec
_PRCTL = _find_prctl()


def _tie() -> None:
    """``preexec_fn``: this child gets SIGKILL when the process that started it dies
    (``PR_SET_PDEATHSIG``), so a killed lane or check leaves nothing running."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGKILL)


def _kill_group(proc: subprocess.Popen[Any]) -> None:
    """The check's whole process group (it was started in a session of its own)."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _env(dry: bool) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(HERE), str(REPO), os.environ.get("PYTHONPATH")) if p)
    if dry:
        env["OMP_NUM_THREADS"] = "1"  # a shared CPU machine: the dry run stays small
    return env


def _probe_env(probe: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = _env(False)
    env["DISTRUN_PLUGINS"] = ",".join(p for p in (os.environ.get("DISTRUN_PLUGINS"),
                                                  "lane_probe") if p)
    env["GPU_LANE_PROBE"] = str(probe)
    env.update(extra or {})
    return env



class Result:
    """A check's figures and notes, rewritten to ``path`` after each change."""

    def __init__(self, path: str, seconds: float) -> None:
        self.path = path
        self.deadline = time.monotonic() + seconds
        self.figures: dict[str, Any] = {}
        self.notes: list[str] = []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def note(self, text: str) -> None:
        print(f"[note] {text}", flush=True)
        self.notes.append(text)
        self.write()

    def write(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"figures": self.figures, "notes": self.notes}, fh, indent=1)
        os.replace(tmp, self.path)


def _run(cmd: list[str], res: Result, cwd: Path | str = REPO, env: dict[str, str] | None = None,
         limit: float | None = None) -> tuple[int, str, float]:
    """Run ``cmd`` (output echoed into this check's output); (exit code, output, seconds)."""
    print(f"$ {' '.join(cmd)}", flush=True)
    started = time.monotonic()
    limit = res.left() if limit is None else min(limit, res.left())
    proc = subprocess.Popen(cmd, cwd=cwd, env=env or _env(False), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=_tie)
    try:
        text, _ = proc.communicate(timeout=max(limit, 1))
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        text = (proc.stdout.read() if proc.stdout else "") + f"\n(timed out after {limit:.0f} s)"
        proc.returncode = 124
    seconds = time.monotonic() - started
    print(text, flush=True)
    print(f"(exit {proc.returncode}, {seconds:.1f} s)", flush=True)
    return proc.returncode, text, seconds
