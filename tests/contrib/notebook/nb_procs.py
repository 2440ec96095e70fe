"""Process checks shared by the notebook tests: is a pid still a live process?"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

from distrun._launch.lifeline import pid_alive

alive = pid_alive  # a running (not zombie) process


def survivors(pids: Iterable[int], within: float = 5.0) -> list[int]:
    """The pids still alive after ``within`` seconds (SIGKILL is delivered asynchronously)."""
    pids = list(pids)
    deadline = time.monotonic() + within
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def read_pids(folder: Path, count: int, timeout: float = 60.0) -> dict[str, int]:
    """Wait until ``count`` files ``*.pid`` exist in ``folder``; name -> pid."""
    deadline = time.monotonic() + timeout
    while True:
        files = sorted(folder.glob("*.pid"))
        texts = {f.stem: f.read_text().strip() for f in files}
        if len(texts) >= count and all(texts.values()):
            return {k: int(v) for k, v in texts.items()}
        if time.monotonic() > deadline:
            raise AssertionError(f"only {texts} appeared in {folder}")
        time.sleep(0.05)


def descendants() -> list[int]:
    """Pids of this process's live descendants (psutil, or a /proc walk)."""
    try:
        import psutil
    except ImportError:
        parents: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                parents.setdefault(ppid, []).append(int(entry.name))
        out, todo = [], [os.getpid()]
        while todo:
            kids = parents.get(todo.pop(), [])
            out += kids
            todo += kids
        return [p for p in out if alive(p)]
    return [p.pid for p in psutil.Process().children(recursive=True) if alive(p.pid)]
