"""The plumbing under the testbed: naming, finding, emptying and removing the
network namespaces a testbed is made of, and sweeping what killed runs left (torch-free).

Names: every namespace of a testbed is ``distrun-<id>-host<K>`` or ``distrun-<id>-switch``, with
``/etc/netns/<name>/hosts`` beside it. ``<id>`` is ``<pid>-<n>`` for a testbed a process made
for itself (n counts its testbeds), which is stale once that pid is dead; or a label (a
lowercase word, ``python -m distrun.testing.hosts up --label``) for one kept until ``down``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time

from distrun._launch.lifeline import pid_alive

__all__ = ["ETC_NETNS", "NETNS_DIR", "PREFIX", "TestbedError", "leftovers", "sweep"]

NETNS_DIR = "/var/run/netns"  # where `ip netns add` pins a namespace (a bind mount)
ETC_NETNS = "/etc/netns"  # `ip netns exec NAME` bind-mounts /etc/netns/NAME/* over /etc/*
PREFIX = "distrun-"
NAME = re.compile(r"^distrun-(?P<bed>.+)-(?P<role>host(?P<index>\d+)|switch)$")
OWNED = re.compile(r"^(?P<pid>\d+)-\d+$")  # the id of a testbed a process made: <pid>-<n>
LABEL = re.compile(r"^[a-z][a-z0-9]{0,15}$")  # the id of a kept testbed

#: ids of this process's testbeds that are up (their namespaces are not stale)
live_ids: set[str] = set()
#: (st_dev, st_ino) of every namespace this process made: its processes must go with it
made: set[tuple[int, int]] = set()


class TestbedError(RuntimeError):
    """A step of building, changing or removing a testbed failed (with the tool's message)."""

    __test__ = False  # not a test class, whatever pytest's name pattern says


def tool(*argv: str, check: bool = True, timeout: float = 30.0) -> str:
    """Run a tool (ip, tc, ss); its stdout. A failure raises with the tool's own message."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TestbedError(f"`{' '.join(argv)}` failed: {exc}") from None
    if check and proc.returncode != 0:
        raise TestbedError(f"`{' '.join(argv)}` failed: {proc.stderr.strip() or proc.stdout}")
    return proc.stdout


def add(name: str) -> None:
    """Make (and pin) the network namespace ``name``."""
    tool("ip", "netns", "add", name)
    ns = identity(os.path.join(NETNS_DIR, name))
    if ns is not None:
        made.add(ns)


def identity(path: str) -> tuple[int, int] | None:
    """A namespace's identity, (device, inode) of its nsfs file at ``path`` (a pinned name or
    ``/proc/PID/ns/net``); None when there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def pids_in(ns: tuple[int, int]) -> list[int]:
    """Live processes whose network namespace is ``ns`` (a zombie has none: it is gone)."""
    return [int(e) for e in os.listdir("/proc")
            if e.isdigit() and identity(f"/proc/{e}/ns/net") == ns]


def kill_all_in(ns: tuple[int, int] | None, timeout: float = 10.0) -> list[int]:
    """SIGKILL every process in ``ns`` until none is left (one may fork while dying)."""
    killed: list[int] = []
    deadline = time.monotonic() + timeout
    while ns is not None:
        pids = [p for p in pids_in(ns) if p != os.getpid()]
        if not pids:
            break
        if time.monotonic() > deadline:
            raise TestbedError(f"processes {pids} survive SIGKILL (uninterruptible sleep?)")
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.02)
    return killed


def remove(name: str) -> list[str]:
    """Delete namespace ``name`` (killing what runs in it first) and its /etc/netns folder;
    what could not be removed."""
    problems = []
    path = os.path.join(NETNS_DIR, name)
    try:
        kill_all_in(identity(path))
    except TestbedError as exc:
        problems.append(str(exc))
    if os.path.exists(path):
        try:
            tool("ip", "netns", "del", name)
        except TestbedError as exc:
            problems.append(str(exc))
    folder = os.path.join(ETC_NETNS, name)
    shutil.rmtree(folder, ignore_errors=True)
    if os.path.exists(folder):
        problems.append(f"{folder} remains")
    return problems


def names_in(folder: str) -> list[str]:
    """Testbed namespace names in ``folder`` (NETNS_DIR or ETC_NETNS)."""
    try:
        return sorted(n for n in os.listdir(folder) if NAME.match(n))
    except OSError:
        return []


def is_stale(name: str) -> bool:
    """Whether ``name`` belongs to a testbed whose maker is gone (labelled ones never are)."""
    m = NAME.match(name)
    owned = OWNED.match(m["bed"]) if m else None
    if m is None or owned is None:
        return False
    pid = int(owned["pid"])
    if pid == os.getpid():  # a dead process of the same pid left it, or ours is down
        return m["bed"] not in live_ids
    return not pid_alive(pid)


def _stale_names() -> list[str]:
    return sorted({n for folder in (NETNS_DIR, ETC_NETNS) for n in names_in(folder)
                   if is_stale(n)})


def leftovers() -> list[str]:
    """What testbeds of dead processes (or this process's, once down) left: namespaces,
    /etc/netns folders, and processes still running in a namespace this process made."""
    pinned = {identity(os.path.join(NETNS_DIR, n)) for n in names_in(NETNS_DIR)
              if not is_stale(n)}
    orphans = sorted(p for ns in made - pinned for p in pids_in(ns) if p != os.getpid())
    return _stale_names() + [f"process {pid} in a removed testbed namespace" for pid in orphans]


def sweep() -> list[str]:
    """Remove what testbeds of dead processes left (namespaces with their processes, hosts
    files); the names removed. Live processes' testbeds and labelled ones are kept."""
    names = _stale_names()
    for name in names:
        remove(name)
    return names
