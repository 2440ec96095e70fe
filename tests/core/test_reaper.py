"""What a test starts ends with the test process, however that ends (issue 26, item 9):
``die_with_parent`` for one child, ``distrun._launch.reaper`` for a server's whole tree (its
orphans and daemons included), both checked by killing the parent with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from distrun._launch.lifeline import pid_alive

#: the "test process": starts CMD (tied as asked), says its pids, then waits to be killed
PARENT = """
import subprocess, sys, time
from distrun._launch.lifeline import die_with_parent
from distrun._launch.reaper import reaped

how, folder = sys.argv[1], sys.argv[2]
# a server that leaves processes behind: a plain child, a double fork, a new session
tree = ("(sleep 600 & echo $! > %s/a) ; (setsid sleep 600 & echo $! > %s/b) ; "
        "echo $$ > %s/c ; exec sleep 600" % (folder, folder, folder))
command = ["sh", "-c", tree]
if how == "reaped":
    subprocess.Popen(reaped(command, grace=1.0))
elif how == "tied":
    subprocess.Popen(command, preexec_fn=die_with_parent())
else:
    subprocess.Popen(command)
time.sleep(600)
"""


def _pids(folder: Path, names: str, parent: subprocess.Popen) -> dict[str, int]:
    deadline = time.monotonic() + 60
    while not all((folder / n).exists() and (folder / n).read_text().strip() for n in names):
        assert parent.poll() is None and time.monotonic() < deadline, "no pids written"
        time.sleep(0.05)
    return {n: int((folder / n).read_text()) for n in names}


def _after_killing_the_parent(tmp_path: Path, how: str, ends: str) -> dict[str, bool]:
    """Which of the tree's processes are alive once those in ``ends`` have ended after the
    parent's SIGKILL (10 s at most); then this test ends them all."""
    (tmp_path / "parent.py").write_text(PARENT)
    parent = subprocess.Popen([sys.executable, "parent.py", how, str(tmp_path)], cwd=tmp_path)
    pids: dict[str, int] = {}
    try:
        pids = _pids(tmp_path, "abc", parent)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while any(pid_alive(pids[n]) for n in ends) and time.monotonic() < deadline:
            time.sleep(0.05)
        return {name: pid_alive(pid) for name, pid in pids.items()}
    finally:
        parent.kill()
        parent.wait()
        for pid in pids.values():  # what the tie missed still ends with this test
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_reaped_tree_ends_with_its_parent_orphans_and_daemons_included(tmp_path):
    assert _after_killing_the_parent(tmp_path, "reaped", "abc") == \
        {"a": False, "b": False, "c": False}


def test_die_with_parent_ends_the_child_but_not_what_it_left(tmp_path):
    # why a server needs the reaper: the tie is the child's only
    assert _after_killing_the_parent(tmp_path, "tied", "c") == {"a": True, "b": True, "c": False}


def test_the_reaper_returns_the_commands_exit_and_ends_what_it_left(tmp_path):
    from distrun._launch.reaper import reaped

    left = tmp_path / "left"
    done = subprocess.run(reaped(["sh", "-c", f"(sleep 600 & echo $! > {left}); exit 5"]),
                          timeout=60)
    assert done.returncode == 5
    assert not pid_alive(int(left.read_text()))
