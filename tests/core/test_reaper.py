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


#: a parent whose thread that started the reaper ends first, the process a moment later: what
#: a SIGKILLed multi-threaded launcher looks like to its children while its threads exit
THREAD_FIRST = """
import ctypes, os, subprocess, sys, threading, time
from distrun._launch.reaper import reaped

folder = sys.argv[1]
subprocess.Popen(reaped(["sh", "-c", "echo $$ > %s/cmd; exec sleep 600" % folder], grace=1.0,
                        remove=folder + "/scratch"))
def end_later():
    while not os.path.exists(folder + "/go"):
        time.sleep(0.02)
    os._exit(0)
threading.Thread(target=end_later).start()
while not os.path.exists(folder + "/cmd"):
    time.sleep(0.02)
ctypes.CDLL(None).pthread_exit(None)  # the main thread ends; the process lives on
"""


def test_the_reaper_outlives_its_parents_thread_and_cleans_up_when_the_process_ends(tmp_path):
    """The kernel's parent-death signal comes when the *thread* that started the reaper ends,
    not the process: here the main thread ends first (as when a SIGKILL takes a launcher's
    threads one by one). The reaper keeps CMD running while the process lives, and removes
    ``--remove`` once it is gone: the memory tier's folder is left in /dev/shm otherwise."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "state").write_text("x")
    (tmp_path / "parent.py").write_text(THREAD_FIRST)
    parent = subprocess.Popen([sys.executable, "parent.py", str(tmp_path)], cwd=tmp_path)
    cmd = 0
    try:
        cmd = _pids(tmp_path, ["cmd"], parent)["cmd"]
        deadline = time.monotonic() + 30
        while (Path(f"/proc/{parent.pid}/task") / str(parent.pid)).exists() and \
                os.listdir(f"/proc/{parent.pid}/task") == [str(parent.pid)]:
            assert time.monotonic() < deadline
            time.sleep(0.02)  # the thread that waits for "go" is up
        status = ""
        while "Z" not in status:  # the main thread has ended (it shows as a zombie)
            assert time.monotonic() < deadline, status
            status = (Path(f"/proc/{parent.pid}/task/{parent.pid}/stat").read_text()
                      .rsplit(")", 1)[1].split()[0])
            time.sleep(0.02)
        time.sleep(1.0)
        assert pid_alive(cmd) and scratch.exists()  # the process lives: so does the tree
        (tmp_path / "go").touch()
        assert parent.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while (scratch.exists() or pid_alive(cmd)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not scratch.exists() and not pid_alive(cmd)
    finally:
        parent.kill()
        parent.wait()
        if cmd:
            try:
                os.kill(cmd, signal.SIGKILL)
            except ProcessLookupError:
                pass
