"""``python -m distrun._launch.reaper --parent PID [--grace S] [--remove DIR] -- CMD ...``: a
process tree tied to the process that started it.

A ``preexec_fn`` tie (:func:`distrun._launch.lifeline.die_with_parent`) ends one child when its
parent dies, not what that child started: a server such as ``ray start --head --block`` leaves
its GCS, raylet and agents behind when it is killed, reparented to init, for as long as the
machine runs. This small process sits between the two. It asks the kernel to

- make it the *subreaper* of everything below it (``PR_SET_CHILD_SUBREAPER``): an orphaned
  descendant is reparented to it, not to init, so the whole tree stays in view;
- send it a signal when the process that started it dies (``PR_SET_PDEATHSIG``), however that
  dies: kill -9 of a pytest included. The kernel sends it when the *thread* that started this
  one ends, its children passing to a sibling thread; so the signal is a cue to look, and the
  parent counts as gone once this process has a new parent (a SIGKILLed launcher's threads
  end one by one: its main thread may be gone while the others still exit).

It runs CMD and waits. On SIGTERM, SIGINT or SIGHUP (or its parent's death) it passes the signal
to CMD, gives it ``--grace`` seconds to stop in order, then SIGKILLs every process still below
it; when CMD exits by itself it does the same to what CMD left. When the parent died it also
removes ``--remove DIR`` (the server's scratch folder, which nobody else will). Its exit code
is CMD's (or 128 + the signal that stopped it). Torch-free; Linux (elsewhere CMD runs, and
only CMD is stopped).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

__all__ = ["descendants", "main", "reaped"]

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
#: what the kernel sends when the parent's thread that started this process ends
_PARENT_THREAD_ENDED = signal.SIGUSR1
_STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_USAGE = ("usage: python -m distrun._launch.reaper --parent PID [--grace SECONDS] [--remove DIR] "
          "-- CMD [ARGS]")


def reaped(command: Sequence[str], grace: float = 10.0, remove: str | None = None) -> list[str]:
    """``command`` wrapped so that its whole process tree ends with this process.

    ``remove``: a folder to delete once the tree is gone, if this process died first.
    """
    extra = ["--remove", remove] if remove else []
    return [sys.executable, "-m", "distrun._launch.reaper", "--parent", str(os.getpid()),
            "--grace", str(grace), *extra, "--", *command]


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (from /proc; zombies included, they await reaping)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


def _prctl(option: int, value: int) -> bool:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _kill_tree(child: subprocess.Popen) -> None:
    """SIGKILL everything below this process until nothing is left (new ones included)."""
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        child.poll()  # CMD's status stays Popen's to collect
        _reap_others(child.pid)
        left = descendants(os.getpid())
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


def _reap_others(child: int) -> None:
    """Collect orphans that ended (not CMD itself: Popen keeps its status)."""
    for pid in descendants(os.getpid()):
        if pid == child:
            continue
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass  # not our child (yet): a grandchild whose parent is alive


def _parse(argv: list[str]) -> tuple[int, float, str, list[str]]:
    if "--" not in argv:
        raise ValueError
    split = argv.index("--")
    options, command = argv[:split], argv[split + 1:]
    values = dict(zip(options[::2], options[1::2]))
    if not command or len(options) % 2 or set(values) - {"--parent", "--grace", "--remove"}:
        raise ValueError
    return (int(values["--parent"]), float(values.get("--grace", "10")),
            values.get("--remove", ""), command)


def main(argv: list[str] | None = None) -> int:
    try:
        parent, grace, remove, command = _parse(list(sys.argv[1:] if argv is None else argv))
    except (ValueError, KeyError):
        print(_USAGE, file=sys.stderr)
        return 2
    received: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        if signum != _PARENT_THREAD_ENDED:
            received.append(signum)

    for signum in (*_STOPS, _PARENT_THREAD_ENDED):
        signal.signal(signum, on_signal)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    _prctl(_PR_SET_PDEATHSIG, _PARENT_THREAD_ENDED)
    if os.getppid() != parent:  # it died before the request: start nothing, leave nothing
        if remove:
            shutil.rmtree(remove, ignore_errors=True)
        return 128 + signal.SIGTERM
    try:
        child = subprocess.Popen(command)
    except OSError as exc:
        print(f"distrun._launch.reaper: cannot run {command[0]}: {exc}", file=sys.stderr)
        return 127
    # From here the signals wait to be asked for (CMD has its own mask already): no polling
    # while nothing happens, and a signal is seen at once.
    wanted = {*_STOPS, _PARENT_THREAD_ENDED, signal.SIGCHLD}
    signal.pthread_sigmask(signal.SIG_BLOCK, wanted)
    look_often_until = 0.0  # after a parent's thread ended: its process may be on its way out
    try:
        while child.poll() is None and not received and os.getppid() == parent:
            often = time.monotonic() < look_often_until
            info = signal.sigtimedwait(wanted, 0.01 if often else 1.0)
            signo = None if info is None else info.si_signo
            if signo == _PARENT_THREAD_ENDED:
                look_often_until = time.monotonic() + 5.0
            elif signo in _STOPS:
                received.append(signo)
            elif signo == signal.SIGCHLD or not often:  # not a /proc walk every 10 ms
                _reap_others(child.pid)
        if child.poll() is None:  # asked to stop, or the parent is gone: CMD first, in order
            child.send_signal(received[0] if received else signal.SIGTERM)
            try:
                child.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
    finally:
        _kill_tree(child)
        if remove and os.getppid() != parent:
            shutil.rmtree(remove, ignore_errors=True)
    if child.returncode is None:
        child.wait()
    code = child.returncode
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
