"""Where each rank is: a small record per rank, written by the rank, read by its launcher.

A rank writes its position into a 128-byte file it maps into memory: the step it finished,
the phase it is in (data, ``training_step``, backward, ...) and since when, and the collective
it waits in (kind, its number among the world's collectives, since when). A write is a
``struct.pack_into`` on the mapping (a few hundred nanoseconds, no system call), so the loop
marks every phase of every step. The launcher reads the files of its node's ranks without
their help: a rank stuck in C, stopped (SIGSTOP) or dead still has its last position there.

The record also carries what :mod:`distrun._diagnose.straggler` needs, each phase's time
summed since the rank last read it, and whether the rank's stack dump is armed
(:mod:`distrun._diagnose.stacks`). Torch-free: the launcher imports it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import time
from dataclasses import dataclass
from enum import IntEnum

__all__ = ["COLLECTIVES", "PART_ENV", "POINT_TO_POINT", "POSITIONS_ENV", "Phase", "Position", "Recorder", "read_position",
           "recorder"]

#: the folder where each rank of this node keeps its record (``rank<N>``), set by the group
POSITIONS_ENV = "DISTRUN_POSITIONS"
#: this rank's worker group among the run's, ``index/count``, where a launcher starts each
#: rank (``NodeRanks.part``; unset: its node and the nodes, torchrun's ``GROUP_RANK`` and
#: ``GROUP_WORLD_SIZE``); the groups' stall reports meet by it (distrun._diagnose.exchange)
PART_ENV = "DISTRUN_PART"

_MAGIC = b"DRP1"
_SIZE = 128
# layout: magic, pid, rank, flags | phase, since | kind, seq, coll_since | step, step_seconds
_HEAD = struct.Struct("<4siii")  # 0
_PHASE = struct.Struct("<i4xd")  # 16: phase, since
_COLL = struct.Struct("<i4xqd")  # 32: kind, seq, since
_KIND = struct.Struct("<i")  # 32: kind alone (0: the collective returned)
_STEP = struct.Struct("<qd")  # 56: steps done, seconds per step (smoothed)
_ALL = struct.Struct("<4siii i4xd i4xqd qd 8x 32s")
#: the kinds of the last world collectives, one byte each at ``_RING + seq % _RING_SIZE``
_RING, _RING_SIZE = 80, 32

#: flags
ARMED = 1  # the rank dumps its stacks on :data:`distrun._diagnose.stacks.DUMP_SIGNAL`


class Phase(IntEnum):
    """What a rank is doing. The loop's phases of one step, in the order a step runs them
    after the step count went up (:func:`order`)."""

    STARTING = 0
    SETUP = 1
    STEP_END = 2  # the step-end hooks: a checkpoint save, callbacks
    BOUNDARY = 3  # the step boundary's vote and metrics
    VALIDATION = 4
    DATA = 5
    FORWARD = 6  # the task's training_step
    BACKWARD = 7
    OPTIMIZER = 8
    EPOCH_END = 9  # this rank finished its epoch's batches
    SCRIPT = 10  # a plain script: somewhere in the user's code
    DONE = 11
    CHECKPOINT = 12  # a checkpoint save (run.save_checkpoint), where the step-end hooks run it
    SERVING = 13  # a rank that serves the others and takes no steps (an RPC parameter server)
    QUORUM = 14  # waiting for the other replica groups to meet (--ft): theirs to name


#: how each phase reads in a summary
PHASE_WORDS = {
    Phase.STARTING: "starting", Phase.SETUP: "setting up", Phase.STEP_END: "at step end "
    "(checkpoint, callbacks)", Phase.BOUNDARY: "at the step boundary",
    Phase.VALIDATION: "in validation", Phase.DATA: "loading data",
    Phase.FORWARD: "in training_step", Phase.BACKWARD: "in backward",
    Phase.OPTIMIZER: "in the optimizer step", Phase.CHECKPOINT: "saving a checkpoint",
    Phase.EPOCH_END: "at its epoch's end (no batches "
    "left)", Phase.SCRIPT: "in the script", Phase.DONE: "done",
    Phase.SERVING: "serving the trainers (takes no steps)",
    Phase.QUORUM: "waiting for the other replica groups (quorum)"}

#: the phases a plugin's own loop marks (:meth:`distrun.plugin.Run.mark`), by name
LOOP_PHASES = {p.name.lower(): p for p in (
    Phase.DATA, Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER, Phase.BOUNDARY,
    Phase.VALIDATION, Phase.CHECKPOINT, Phase.QUORUM)}

#: the collectives a rank can wait in, numbered from 1 in the record
COLLECTIVES = (
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier", "reduce", "gather",
    "scatter", "all_gather_object", "broadcast_object_list", "gather_object",
    "scatter_object_list", "send", "recv", "monitored_barrier", "batch_isend_irecv",
    "process group start", "all_gather_single", "reduce_scatter_single", "all_gather_coalesced",
    "all_reduce_coalesced", "send_object_list", "recv_object_list")
# (not isend and irecv: torch's P2POp checks that its op *is* torch's own isend or irecv)
#: point-to-point operations: one rank's send is another's recv, and a pipeline stage has its
#: own count of them, so they are marked but not numbered
POINT_TO_POINT = frozenset({"send", "recv", "batch_isend_irecv", "send_object_list",
                            "recv_object_list"})


@dataclass(frozen=True)
class Position:
    """One rank's record as its launcher read it."""

    rank: int
    pid: int
    armed: bool
    phase: Phase
    since: float  # time.monotonic() when the phase began (the clock is the host's)
    kind: str  # the collective it waits in ("": none)
    seq: int  # collectives of the world group entered so far
    coll_since: float
    step: int  # optimizer steps finished
    step_seconds: float  # smoothed seconds per step (0: none yet)
    ring: bytes = b""  # the kinds of the last world collectives (:meth:`kind_of`)

    def kind_of(self, seq: int) -> int | None:
        """The kind of this rank's world collective number ``seq`` (None: not remembered)."""
        if not self.ring or seq < 1 or not self.seq - _RING_SIZE < seq <= self.seq:
            return None
        return self.ring[seq % _RING_SIZE]

    def key(self) -> tuple[int, int, int]:
        """How far the rank got: steps, the phase's place in a step, collectives entered."""
        return self.step, order(self.phase), self.seq

    def moved(self, other: Position | None) -> bool:
        return other is None or (self.step, self.phase, self.seq, self.kind, self.since) != (
            other.step, other.phase, other.seq, other.kind, other.since)


def order(phase: Phase) -> int:
    """A phase's place among those of one step (STARTING and SETUP before all, DONE after)."""
    if phase == Phase.CHECKPOINT:
        return int(Phase.STEP_END)
    if phase == Phase.SCRIPT:  # a plain script between its backward and optimizer steps
        return int(Phase.FORWARD)
    return int(phase)


def read_position(path: str) -> Position | None:
    """The record at ``path`` (None: none there yet, or not a record)."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(_ALL.size)
    except OSError:
        return None
    if len(raw) < _ALL.size:
        return None
    magic, pid, rank, flags, phase, since, kind, seq, coll_since, step, step_s, ring = \
        _ALL.unpack(raw)
    if magic != _MAGIC:
        return None
    try:
        ph = Phase(phase)
    except ValueError:
        ph = Phase.STARTING
    name = COLLECTIVES[kind - 1] if 0 < kind <= len(COLLECTIVES) else ""
    return Position(rank, pid, bool(flags & ARMED), ph, since, name, seq, coll_since, step,
                    step_s, ring)


class Recorder:
    """The rank's side: marks its phases, steps and collectives into its record."""

    def __init__(self, folder: str, rank: int) -> None:
        path = os.path.join(folder, f"rank{rank}")
        fd = os.open(path + ".tmp", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, _SIZE)
            self._map = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)
        self.path = path
        self.rank = rank
        self._flags = 0
        _HEAD.pack_into(self._map, 0, _MAGIC, os.getpid(), rank, 0)
        self.current = Phase.STARTING
        self._since = time.monotonic()
        _PHASE.pack_into(self._map, 16, int(self.current), self._since)
        self.seq = 0
        self._depth = 0  # collectives nest (all_gather_object runs all_gather): the outer counts
        self._step_started = 0.0
        self._step_seconds = 0.0
        #: seconds spent in each phase since :meth:`take_times` last read them
        self.times = [0.0] * len(Phase)
        #: distrun's loop marks the steps (a script's optimizer hooks then stay quiet)
        self.in_loop = False
        os.replace(path + ".tmp", path)  # the launcher never reads a record without its head

    def set_flag(self, flag: int) -> None:
        self._flags |= flag
        _HEAD.pack_into(self._map, 0, _MAGIC, os.getpid(), self.rank, self._flags)

    def phase(self, phase: Phase) -> None:
        """From now on the rank is in ``phase``."""
        now = time.monotonic()
        self.times[self.current] += now - self._since
        self.current = phase
        self._since = now
        _PHASE.pack_into(self._map, 16, phase, now)

    def step_done(self, step: int) -> None:
        """Optimizer step ``step`` is done; the step-end hooks run next."""
        now = time.monotonic()
        if self._step_started:
            took = now - self._step_started
            self._step_seconds = took if not self._step_seconds \
                else 0.9 * self._step_seconds + 0.1 * took
        self._step_started = now
        _STEP.pack_into(self._map, 56, step, self._step_seconds)
        self.phase(Phase.STEP_END)

    def enter(self, kind: int, world: bool) -> None:
        """A collective of kind ``kind`` (1-based, :data:`COLLECTIVES`) starts; ``world``:
        on the world group (those are numbered: every rank counts the same)."""
        self._depth += 1
        if self._depth == 1:
            if world:
                self.seq += 1
                self._map[_RING + self.seq % _RING_SIZE] = kind
            _COLL.pack_into(self._map, 32, kind, self.seq, time.monotonic())

    def leave(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            _KIND.pack_into(self._map, 32, 0)
            if self.current is Phase.SCRIPT:  # a script's time counts from its last collective
                self._since = time.monotonic()
                _PHASE.pack_into(self._map, 16, Phase.SCRIPT, self._since)

    def totals(self) -> list[float]:
        """Each phase's seconds so far (the current phase's included), by :class:`Phase`:
        each reader keeps the totals it last read and takes the difference."""
        now = time.monotonic()
        self.times[self.current] += now - self._since
        self._since = now  # (the record's ``since`` stays: the phase did not change)
        return list(self.times)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.phase(Phase.DONE)
            self._map.close()


class _Off:
    """The recorder of a rank that keeps no record: every mark does nothing."""

    current = Phase.STARTING
    in_loop = False

    def phase(self, phase: Phase) -> None:
        return None

    def step_done(self, step: int) -> None:
        return None


_OFF = _Off()
_recorder: Recorder | None = None


def recorder() -> Recorder | None:
    """This rank's recorder (None: not started by distrun's launcher)."""
    return _recorder


def marks() -> Recorder | _Off:
    """This rank's recorder, or one whose marks do nothing: what the loop calls."""
    return _recorder if _recorder is not None else _OFF


def start_recorder(rank: int, environ: dict[str, str] | None = None) -> Recorder | None:
    """Open this rank's record in the folder the launcher named (once a process)."""
    global _recorder
    env = os.environ if environ is None else environ
    folder = env.get(POSITIONS_ENV)
    if _recorder is None and folder and os.path.isdir(folder):
        try:
            _recorder = Recorder(folder, rank)
        except (OSError, ValueError):
            _recorder = None  # the diagnosis is lost, never the run
    return _recorder
