"""A plain script (no torch): writes what a worker process inherited, then fails once.

Written to ``$DUMP_DIR/attempt<A>-rank<R>.json``: the environment, the working directory, the
command line, the descriptors and the standard streams, the session and process group, the
signal dispositions and mask, the parent (a launcher or a warm spare). Rank 1 of the first
attempt exits with code 3 after writing, once rank 0 has written too (its exit stops rank 0:
under load rank 0 may not have got that far yet); every other start exits 0.
"""

import json
import os
import signal
import sys
import time


def _handler(signum):
    handler = signal.getsignal(signum)
    if handler in (signal.SIG_DFL, signal.SIG_IGN, None):
        return str(handler)
    return getattr(handler, "__name__", "python")


def _fd(fd):
    target = os.readlink(f"/proc/self/fd/{fd}")
    return "file" if target.startswith("/") else target.split(":")[0]


def _parent():
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as fh:
        argv = fh.read().decode(errors="replace").split("\0")
    return argv[argv.index("-m") + 1] if "-m" in argv[:-1] else argv[0]


fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
dump = {
    "env": dict(os.environ),
    "cwd": os.getcwd(),
    "argv": sys.argv,
    "orig_argv": sys.orig_argv,
    "path0": sys.path[0],
    "main": sys.modules["__main__"].__file__,
    "fds": {fd: _fd(fd) for fd in fds if fd < 3},
    "open_fds": len(fds),  # 0-2 and the one listdir holds
    "session_leader": os.getsid(0) == os.getpid(),
    "group_leader": os.getpgid(0) == os.getpid(),
    "signals": {s.name: _handler(s) for s in signal.Signals
                if s not in (signal.SIGKILL, signal.SIGSTOP)},
    "mask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "flags": list(sys.flags),
    "stdout": [sys.stdout.isatty(), sys.stdout.line_buffering, sys.stdout.encoding,
               getattr(sys.stdout, "write_through", None)],
    "stderr": [sys.stderr.line_buffering, sys.stderr.encoding],
    "launcher_is_parent": os.environ.get("DISTRUN_LAUNCHER_PID") == str(os.getppid()),
    "parent": _parent(),
    "threads": len(os.listdir("/proc/self/task")),
}
attempt, rank = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]
folder = os.environ["DUMP_DIR"]
path = os.path.join(folder, f"attempt{attempt}-rank{rank}.json")
with open(path + ".tmp", "w") as fh:  # whole or absent: the test reads every *.json
    json.dump(dump, fh)
os.rename(path + ".tmp", path)
print(f"rank {rank} attempt {attempt} says hello", flush=True)
if attempt == "0" and rank == "1":
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(folder, "attempt0-rank0.json")):
        if time.monotonic() > deadline:
            sys.exit("rank 0 wrote nothing in 120 s")
        time.sleep(0.02)
    sys.exit(3)
