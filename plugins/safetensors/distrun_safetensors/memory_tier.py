"""The memory tier: checkpoints kept in the node's memory, outliving the workers that wrote them.

``--ckpt-memory-every-n-steps N`` saves the run's state every N steps into a folder in
``/dev/shm`` (memory, not disk) that the node's launcher owns, not the workers: a worker
killed by a fault leaves the folder behind, and its restart on this node loads the newest
committed checkpoint from it at memory speed instead of reading the disk. The folder holds
ordinary checkpoints of this plugin's format (the same shards, checksums and commit rule: a
save cut short is never loaded), written in the background while training goes on. The disk
checkpoints (``--ckpt-every-n-steps``, the end's) stay the durable copy; a resume takes the
newest committed checkpoint of either place.

The saves copy the state straight into their files (:mod:`~distrun_safetensors.in_place`): two
copies of it held, no buffers. A disk checkpoint of the cadence is written from the tier's copy
of its step (:func:`memory_snapshot`), in the background. A step's commit is waited for before
the next step is applied, so a kill at any moment redoes at most one finished step.

Two halves:

- :class:`MemoryTier`, the node service (launcher side, torch-free): makes the folder at its
  first group's start, hands it to every worker (``DISTRUN_CKPT_MEMORY_DIR``) and removes it
  when the launcher ends, however it ends: at exit, and by a reaper process that outlives a
  kill -9 of the launcher; folders of launchers that are gone are swept at the next start.
- :class:`MemoryCadence`, the worker's hooks: a save every N steps into the folder, with the
  room checked at the first one (too little memory turns the tier off with one line; the run
  goes on with its disk checkpoints, never out of memory mid-run), and the wait for the
  commit before the next optimizer step.

Across nodes each node's folder holds a checkpoint of what its own ranks hold, saved by them
alone (a :class:`~distrun_safetensors.save.Scope`: replicated state once per node), so a
state every node holds whole (data parallel, replicated or sharded within the node) restarts
from memory on every node, and the survivors of a lost node from their own. A state sharded
across nodes is saved as each node's part, and each node's part is copied into the next
node's memory (:mod:`~distrun_safetensors.replica`), so the survivors of a lost node re-form
from their part and the lost node's copy. No node prunes a step before every node committed
the next, and a restart takes the newest step all of them hold (:mod:`~distrun_safetensors.
tier_nodes`). A run under ``--ft`` keeps its disk checkpoints only (its replica groups heal
from a live peer).
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import math
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from distrun.plugin import StashKey, hookimpl, reaped

__all__ = ["ENV", "MemoryCadence", "MemoryTier", "memory_snapshot", "note_resume", "start_tier",
           "tier_dir"]

#: the variable that names the tier's folder to the workers
ENV = "DISTRUN_CKPT_MEMORY_DIR"
_PREFIX = "distrun-ckpt-memory-"
#: the tier's checkpointer and cadence (a worker's)
_SAVER: StashKey[Any] = StashKey("safetensors.memory")
_CADENCE: StashKey[Any] = StashKey("safetensors.memory.cadence")
#: the tier's step this worker resumed from, and the folder it read
_RESUMED: StashKey[tuple[int, str]] = StashKey("safetensors.memory.resumed")


def _memory_root() -> str:
    """Where the tier lives: ``/dev/shm`` (memory) when there is one, else the temp folder."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) \
        else tempfile.gettempdir()


def sweep_orphans(root: str) -> list[str]:
    """Remove the tier folders in ``root`` whose launcher is gone; the removed paths."""
    removed = []
    for path in glob.glob(os.path.join(root, _PREFIX + "*")):
        pid = os.path.basename(path)[len(_PREFIX):].split("-")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class MemoryTier:
    """The node's memory tier folder (a :class:`~distrun.plugin.NodeService`).

    The launcher keeps one service for all its worker groups, so the folder lives from the
    first start of the node's workers to the launcher's end, through every restart.
    """

    #: what it keeps is for the next start of the node's workers (a launcher that places
    #: each restart anew leaves it out: distrun.plugin.NodeService)
    across_restarts = True

    def __init__(self, root: str | None = None) -> None:
        self.root = root or _memory_root()
        self.path: str | None = None
        self._keeper: subprocess.Popen[bytes] | None = None

    def worker_env(self, group: Any) -> Mapping[str, str]:
        if self.path is None:
            self._make()
        return {ENV: self.path or ""}

    def started(self, group: Any) -> None:
        """Nothing to do: the folder was made before the workers started."""

    def ended(self, group: Any) -> None:
        """Nothing to do: the folder outlives the workers (that is its point)."""

    def _make(self) -> None:
        sweep_orphans(self.root)
        self.path = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=self.root)
        atexit.register(self.close)
        # removes the folder when this process dies, kill -9 included (sleep is what it waits on)
        with contextlib.suppress(OSError):
            self._keeper = subprocess.Popen(reaped(["sleep", "infinity"], grace=0.0,
                                                   remove=self.path),
                                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL, start_new_session=True)

    def close(self) -> None:
        """Remove the folder and end its keeper (at the launcher's exit)."""
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = None
        keeper, self._keeper = self._keeper, None
        if keeper is not None and keeper.poll() is None:
            keeper.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                keeper.wait(timeout=5)


def tier_dir() -> str | None:
    """The memory tier's folder given to this worker by its launcher, None without one."""
    path = os.environ.get(ENV, "")
    return path if path and os.path.isdir(path) else None


def _free_bytes(path: str) -> int:
    """What the tier can still take: the folder's free space and the memory not yet in use
    (a file in /dev/shm is memory: the smaller of the two)."""
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                free = min(free, int(line.split()[1]) * 1024)
    return free


def _size(n: float) -> str:
    return f"{n / (1 << 30):.1f} GB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MB"


class MemoryCadence:
    """Saves into the memory tier every ``every`` steps (each rank holds one)."""

    def __init__(self, every: int, folder: str, max_gb: float, copies: int = 2,
                 scope: Any = None) -> None:
        self.every, self.folder, self.max_gb, self.copies = every, folder, max_gb, copies
        self.scope = scope  # across nodes: this node's ranks (a save.Scope)
        self.off = False
        self.checked = False
        self.saved: int | None = None  # the step of the last save
        self.cost = SaveCost()

    def room(self, local_world: int) -> Any:
        """The check of the first save: its bytes (this rank's share) -> a refusal or None.

        ``copies`` of the state are held: the newest committed checkpoint and the one being
        written (the saves copy straight into their files: no buffers, see in_place.py), and
        one more while a disk save writes from the tier's copy for longer than a step.
        """

        def check(nbytes: int) -> str | None:
            if self.checked:
                return None
            self.checked = True
            need = nbytes * local_world * self.copies
            free = _free_bytes(self.folder)
            limit = min(free, int(self.max_gb * (1 << 30))) if self.max_gb else free
            if need <= limit:
                return None
            what = f"--ckpt-memory-max-gb {self.max_gb:g} allows" if self.max_gb and \
                limit < free else f"{os.path.dirname(self.folder)} has {_size(free)} free"
            copies = {2: "two", 3: "three", 4: "four", 5: "five"}.get(self.copies,
                                                                       str(self.copies))
            return (f"it needs about {_size(need)} ({copies} copies of this node's state) and "
                    f"{what}")

        return check

    @hookimpl(trylast=True)  # after the step's other hooks, as the disk cadence saves
    def distrun_on_step_end(self, run, step):
        if not self.off and step % self.every == 0 and self.saved != step:
            self.save(run, step)

    @hookimpl(wrapper=True)
    def distrun_optimizer_step(self, run):
        """The save of the step before is committed before this step is applied, so a kill at
        any moment redoes at most one finished step (the wait is nothing when the commit kept
        up with the step's forward and backward)."""
        saver = run.stash.get(_SAVER)
        if saver is not None and saver.pending is not None and not self.off:
            from distrun_safetensors.errors import CheckpointError, FencedError

            started = time.perf_counter()
            try:
                saver.wait()
            except (CheckpointError, FencedError) as exc:
                self._turn_off(run, saver, str(exc))
            self.cost.waited(time.perf_counter() - started)
        return (yield)

    def save(self, run: Any, step: int) -> None:
        """Save ``step`` into the tier (every rank together); a failure turns the tier off."""
        from distrun_safetensors.errors import CheckpointError, FencedError

        saver = memory_checkpointer(run, self)
        self.saved = step
        started = time.perf_counter()
        try:
            saver.save(step, run.unwrapped_model(), run.optimizer, run.state_dict(),
                       reason="memory", info=_info(run))
        except (CheckpointError, FencedError) as exc:
            self._turn_off(run, saver, str(exc))
            return
        said = self.cost.saved(started, step, saver.stats)
        if said and run.is_global_zero:
            run.log.warning("warning: memory tier: %s", said)

    def _turn_off(self, run: Any, saver: Any, why: str) -> None:
        """The tier is given up for this run, said once; the disk checkpoints go on."""
        self.off = True
        why = re.sub(r"^checkpoint step \d+ was not saved: ", "", why)
        if run.is_global_zero:
            run.log.warning("warning: memory tier off: %s; checkpoints go to the disk only "
                            "(--ckpt-memory-every-n-steps 0 turns it off)", why)
        with contextlib.suppress(Exception):
            saver.wait()

    @hookimpl
    def distrun_on_fit_end(self, run):
        saver = run.stash.get(_SAVER)
        if saver is not None and not self.off:
            try:
                saver.wait()
            except Exception as exc:  # the disk copy is the durable one: said, not raised
                self._turn_off(run, saver, str(exc))


class SaveCost:
    """How long the tier's saves hold the training up: measured over :attr:`SAVES` saves after
    the first :attr:`SKIP` (which take fresh pages), and said once when that is more than
    :attr:`LINE` of the time, with a cadence that would bring it to about that. A save holds the
    step that makes it for the copy of the state (and for the write before it, if that is
    not done), and the next step before its optimizer step for the commit."""

    SKIP, SAVES, LINE = 2, 10, 0.05

    def __init__(self) -> None:
        self.count = 0
        self.copy = self.wait = 0.0
        #: (time, step) at the start of the first measured save; None before it
        self.start: tuple[float, int] | None = None
        self.done = False

    def waited(self, seconds: float) -> None:
        """The wait for a measured save's commit before the next optimizer step."""
        if self.start is not None and not self.done:
            self.wait += seconds

    def saved(self, started: float, step: int, stats: Mapping[str, Any]) -> str | None:
        """A save of ``step`` begun at ``started`` (perf_counter) held the step for
        ``stats``; once the measure is done, what to say (None: nothing)."""
        if self.done:
            return None
        self.count += 1
        if self.count <= self.SKIP:
            return None
        if self.start is None:
            self.start = (started, step)
        elif self.count > self.SKIP + self.SAVES:
            self.done = True
            return self._verdict(started - self.start[0], step - self.start[1])
        waited = float(stats.get("waited_s") or 0.0)
        self.copy += max(0.0, float(stats.get("stall_s") or 0.0) - waited)
        self.wait += waited
        return None

    def _verdict(self, elapsed: float, steps: int) -> str | None:
        held = self.copy + self.wait
        if steps <= 0 or elapsed <= 0 or held <= self.LINE * elapsed:
            return None
        step_s = max(elapsed - held, 1e-6) / steps  # a step without the saves
        per_save = held / self.SAVES
        every = max(steps // self.SAVES + 1, math.ceil(per_save / (self.LINE * step_s)))
        return (f"its saves take {held / elapsed:.0%} of the training time here (each: "
                f"{self.copy / self.SAVES * 1e3:.0f} ms copying this rank's state, "
                f"{self.wait / self.SAVES * 1e3:.0f} ms waiting for a commit; a step takes "
                f"{step_s * 1e3:.0f} ms without them); --ckpt-memory-every-n-steps {every} "
                f"would bring that to about {self.LINE:.0%}")


def _info(run: Any) -> dict[str, Any]:
    from distrun_safetensors.manifest import RUN
    from distrun_safetensors.session import run_key

    return {"strategy": getattr(run.strategy, "name", None),
            "progress": run.progress.state_dict(), RUN: run_key(), "tier": "memory"}


def memory_checkpointer(run: Any, cadence: MemoryCadence) -> Any:
    """This rank's checkpointer of the memory tier (made at its first use)."""
    saver = run.stash.get(_SAVER)
    if saver is None:
        from distrun_safetensors.save import Checkpointer
        from distrun_safetensors.session import _opts

        saver = Checkpointer(cadence.folder, keep_last=1,
                             split_bytes=int(_opts(run).ckpt_split_mb * (1 << 20)),
                             async_save=True, rdzv_generation=run.generation, in_place=True,
                             scope=cadence.scope)
        from distrun_safetensors.tier_nodes import local_world

        saver.room_check = cadence.room(local_world(run))
        if _RESUMED in run.stash:  # its newest committed step: the files of older ones are
            saver.last = run.stash[_RESUMED]  # written over (in_place.py)
        run.stash[_SAVER] = saver
    return saver


def memory_snapshot(run: Any) -> Any:
    """The memory tier's copy of this step for a disk save to write from (a
    :class:`~distrun_safetensors.in_place.Snapshot`, pinned until that write is done), saved
    into the tier now if its cadence has not this step; None without the tier."""
    cadence = run.stash.get(_CADENCE)
    if cadence is None or cadence.off:
        return None
    step = run.progress.step
    if cadence.saved != step:
        cadence.save(run, step)
    saver = run.stash.get(_SAVER)
    return saver.snapshot(step) if saver is not None and not cadence.off else None


def note_resume(run: Any, step: int, path: str, tier: str | None) -> None:
    """A resume read ``path`` (``step``): from the memory tier's folder ``tier``, its saves
    go on from that step (the spares a killed process left are written over)."""
    if tier is not None and os.path.abspath(path).startswith(os.path.abspath(tier) + os.sep):
        run.stash[_RESUMED] = (step, path)
    else:
        run.stash.pop(_RESUMED, None)


def wait_for_memory_save(run: Any) -> None:
    """Let the memory tier's save in flight finish (before a load reads the folder)."""
    saver = run.stash.get(_SAVER)
    if saver is not None:
        with contextlib.suppress(Exception):
            saver.wait()


def start_tier(run: Any, every: int, max_gb: float, replica_mb_s: float = 0.0) -> None:
    """At the fit's start: the memory cadence, where the tier can be used (else one line)."""
    from distrun_safetensors import comm
    from distrun_safetensors.replica import replica_dir
    from distrun_safetensors.tier_nodes import (
        local_world,
        node_holds_all,
        node_scope,
        nodes_of,
        views_name,
    )

    folder, scope, why = tier_dir(), None, None
    if folder is not None:  # what the resume read through is let go (links hold memory)
        shutil.rmtree(os.path.join(folder, views_name(run.rank)), ignore_errors=True)
    if run.config.get("ft"):  # (its launcher made no folder)
        why = "under --ft a replica group heals from a live replica instead"
    elif run.world_size != local_world(run):
        known = nodes_of(run, folder)
        if known is None:
            why = "a node's launcher holds no folder for it (run under `distrun run`)"
        else:
            nodes = known[0]
            node = next(n for n in nodes if run.rank in n)
            split = comm.agree(None if node_holds_all(run.unwrapped_model(), node)
                               else f"rank {run.rank}")
            # sharded across nodes: each node saves its part, copied into the next node's memory
            scope = node_scope(run, nodes, replica_mb_s if split else None)
    elif folder is None:
        why = "no launcher holds it (run under `distrun run`)"
    if why is not None or folder is None:
        if run.is_global_zero:
            run.log.warning("warning: memory tier off: %s; checkpoints go to the disk only", why)
        return
    if scope is None or scope.ring is None:  # no replica to keep (nodes re-formed without one)
        shutil.rmtree(replica_dir(folder), ignore_errors=True)
    if run.is_global_zero:  # a save of a worker killed mid-write: its memory is given back
        from distrun_safetensors.leftovers import sweep_stale

        sweep_stale(folder, timeout=run.config.timeout)
    from distrun_safetensors.session import _opts

    opts = _opts(run)  # a disk cadence writes from the tier's copy: one more held meanwhile
    copies = 3 if opts.ckpt_every_n_steps or opts.ckpt_every_n_seconds else 2
    if scope is not None and scope.ring is not None:  # the previous node's part, as many
        copies += 2
    run.stash[_CADENCE] = cadence = MemoryCadence(every, folder, max_gb, copies, scope)
    run.add_hooks(cadence)
