"""Registers ``shm`` with torch.distributed and makes one backend per process group.

Making a group (every member runs :func:`_create`): the ranks publish their machine and pid
in the group's store and refuse a group that spans machines; rank 0 removes segments left by
dead runs, creates the group's segment and publishes its name; the others map it; once every
rank has mapped it, rank 0 unlinks the name, so nothing stays in /dev/shm whatever happens to
the processes after that (the memory lives as long as a mapping does).
"""

from __future__ import annotations

import datetime
import itertools
import os
import secrets
import socket
from typing import Any

from distrun.plugin import ProcessId

__all__ = ["creator_gone", "leftover_segments", "load", "machine_id", "remove_stale_segments",
           "segment_prefix", "segments"]

_loaded = False
_counter = itertools.count()

SLOT_KB = int(os.environ.get("DISTRUN_SHM_SLOT_KB", "1024"))
RING_KB = int(os.environ.get("DISTRUN_SHM_RING_KB", "256"))
SMALL_KB = int(os.environ.get("DISTRUN_SHM_SMALL_KB", "64"))


def load() -> None:
    """Build or find the extension and register ``shm`` for CPU tensors (idempotent)."""
    global _loaded
    if _loaded:
        return
    import torch.distributed as dist

    from distrun_shm.build import load_extension

    load_extension()
    dist.Backend.register_backend("shm", _create, extended_api=True, devices=["cpu"])
    _loaded = True


def machine_id() -> str:
    """This machine as the backend compares it: host name, boot id and network namespace (or
    the override ``DISTRUN_SHM_MACHINE_ID``, which tests use to play several machines).

    Network namespaces of one machine share its boot id, and may share a host name: each is a
    host of its own to the ranks (a container, or a node of distrun's multi-host testbed).
    """
    override = os.environ.get("DISTRUN_SHM_MACHINE_ID")
    if override:
        return override
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    try:
        net = os.readlink("/proc/self/ns/net")
    except OSError:
        net = "?"
    return f"{socket.gethostname()}/{boot}/{net}"


def segment_prefix() -> str:
    """Names of this user's segments start so in /dev/shm, then the creator (``<pid>.<start>-``,
    its pid and start time: see :func:`creator_gone`)."""
    return f"distrun-shm-{os.getuid()}-"


def _creator_tag() -> str:
    return str(ProcessId.of(os.getpid()))


def creator_gone(name: str) -> bool:
    """Whether the process that created segment ``name`` (one of this user's) has ended.

    By pid and start time: a pid the kernel gave to another process since is gone too. A name
    without a start time (written by an earlier version) is judged by its pid alone.
    """
    tag = name[len(segment_prefix()):].split("-", 1)[0]
    creator = ProcessId.parse(tag)
    if creator is None:
        return False  # not a name this backend writes: not ours to judge
    return not creator.alive()


def segments() -> list[str]:
    """This user's segments in /dev/shm (live runs' and abandoned ones), by name."""
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(segment_prefix()))
    except OSError:
        return []


def leftover_segments() -> list[str]:
    """This user's segments in /dev/shm whose creator has ended (a kill -9 of a rank or its
    launcher in the window between creating and unlinking); a live creator's belong to a run
    still going."""
    return [name for name in segments() if creator_gone(name)]


def remove_stale_segments() -> list[str]:
    """Unlink the segments :func:`leftover_segments` finds; their names."""
    removed: list[str] = []
    for name in leftover_segments():
        try:
            os.unlink(os.path.join("/dev/shm", name))
            removed.append(name)
        except OSError:
            pass
    return removed


def _one_machine(store: Any, rank: int, size: int, global_ranks: list[int],
                 timeout: datetime.timedelta) -> list[int]:
    """The group's pids, after checking all its ranks run on this machine."""
    me = machine_id()
    store.set(f"shm/who/{rank}", f"{os.getpid()}|{me}")
    whos = [store.get(f"shm/who/{r}").decode().partition("|") for r in range(size)]
    apart = next((r for r, (_, _, machine) in enumerate(whos) if machine != me), None)
    if apart is None:
        return [int(pid) for pid, _, _ in whos]
    # Every rank has read every rank's entry before any leaves: the store may live in the
    # process of one of them, and a rank still reading would get a lost connection instead
    # of this line.
    store.set(f"shm/checked/{rank}", "1")
    try:
        store.wait([f"shm/checked/{r}" for r in range(size)], timeout)
    except Exception:  # noqa: BLE001 - a rank that never comes: say what this one knows
        pass
    from distrun.plugin import UsageError

    other = global_ranks[apart] if apart < len(global_ranks) else apart
    mine = global_ranks[rank] if rank < len(global_ranks) else rank
    there, here = whos[apart][2].split("/")[0], me.split("/")[0]
    if there == here:  # same name, another boot or network namespace
        there = f"{there} (another host of that name)"
    raise UsageError(
        f"the shm backend reaches ranks of one machine only, but rank {other} runs on "
        f"{there} and rank {mine} on {here}: use --backend gloo for a run over several nodes")


def _create(options: Any, _backend_options: Any) -> Any:
    from distrun_shm.build import load_extension

    ext = load_extension()
    store, rank, size = options.store, options.group_rank, options.group_size
    timeout = options.timeout
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(
        timeout)
    pids = _one_machine(store, rank, size, list(options.global_ranks_in_group or []),
                        datetime.timedelta(seconds=seconds))
    sizes = dict(slot_bytes=SLOT_KB * 1024, ring_bytes=RING_KB * 1024,
                 small_bytes=SMALL_KB * 1024, timeout_s=seconds)
    if rank != 0:
        name = store.get("shm/name").decode()
        backend = ext.create(rank, size, name, False, pids, **sizes)
        store.set(f"shm/mapped/{rank}", "1")
        return backend
    remove_stale_segments()
    name = f"/{segment_prefix()}{_creator_tag()}-{next(_counter)}-{secrets.token_hex(4)}"
    backend = ext.create(0, size, name, True, pids, **sizes)
    try:
        store.set("shm/name", name)
        if size > 1:
            store.wait([f"shm/mapped/{r}" for r in range(1, size)], timeout)
    finally:
        ext.unlink(name)
    return backend
