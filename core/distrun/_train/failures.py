"""What a failed stage tells its user: the table of the failures distrun recognises.

A stage that raises something other than a :class:`DistrunError` (which already is one line)
is matched against :data:`CASES`. A case is one kind of failure torch or a backend reports in
its own way: its name, a predicate ``(exc, run) -> bool`` that tells it (by type, by where the
exception was raised, or by evidence such as a stop signal or the time waited; by text only
where torch gives nothing better), a message builder ``(exc, run) -> str`` for the one line
the user reads, and the error class (:class:`UsageError`, exit 2: the user asked the backend
for something it cannot do; :class:`DistrunError`, exit 1: the run failed).

The order matters: the first case whose predicate holds wins. Several predicates accept the
same exception (a ``DistNetworkError`` is a ``DistError``; gloo's timeout text names its
transport's source file, as a dropped connection's does), and the lost-peer case waits for a
stop signal, so it is last. :func:`classify` returns the first match's error, or None: the
exception is re-raised as it is, with its traceback.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from distrun._launch.exits import signal_note
from distrun._launch.failure_note import FailureNote
from distrun._spec.errors import DistrunError, UsageError, first_line
from distrun._spec.stash import StashKey

if TYPE_CHECKING:
    from distrun._train.run import Run

__all__ = ["CASES", "TRAINING", "Case", "classify", "stopped_for_failure"]

#: set by the trainer once the loop starts: a timeout before that is a rank stuck before
#: training, not ranks out of step
TRAINING: StashKey[bool] = StashKey("trainer.training")

#: where torch raises a failed collective: c10d calls, DDP's reducer, autograd's backward
_COLLECTIVE_MODULES = ("torch.distributed", "torch.nn.parallel", "torch.autograd")
#: ... and distrun's own collectives of the loop (the stop agreement, the metric reduction)
_LOOP_COLLECTIVE_MODULES = (*_COLLECTIVE_MODULES, "distrun._train.step_sync")

#: c10d's words for an operation a backend lacks ("Backend shm does not support alltoall"),
#: and a plugin backend's for a dtype ("shm backend: allreduce does not support dtype UInt32")
_MISSING_OP = re.compile(r"Backend (\S+) does not (?:support|implement) (\w+)")
_MISSING_DTYPE = re.compile(r"(\S+) backend: (\w+) does not support (dtype \S+)")

#: seconds a rank whose collective failed waits for its launcher's stop signal
_PEER_GRACE = 3.0

#: gloo gives a dropped connection no type of its own, but names its transport's source file
_TRANSPORT_SOURCES = ("/gloo/transport/",)


@dataclass(frozen=True)
class Case:
    """One kind of failure: how it is told, the line the user reads, the error it becomes."""

    name: str
    matches: Callable[[BaseException, Run], bool]
    message: Callable[[BaseException, Run], str]
    error: type[DistrunError]


def classify(exc: BaseException, run: Run) -> DistrunError | None:
    """The error of the first case of :data:`CASES` that ``exc`` matches, or None."""
    for case in CASES:
        if case.matches(exc, run):
            return case.error(case.message(exc, run))
    return None


# -- network: torch could not reach a peer or the store ----------------------------------------
def _is_network_error(exc: BaseException, run: Run) -> bool:
    """torch could not reach a peer or the rendezvous store (not a timeout: refused, reset,
    address in use)."""
    dist = sys.modules.get("torch.distributed")
    kind = getattr(dist, "DistNetworkError", None)
    return kind is not None and isinstance(exc, kind)


def _network_message(exc: BaseException, run: Run) -> str:
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    return (f"rank {run.rank}: a network error with the other ranks or the store at {where} "
            f"(step {run.progress.step}): {first_line(exc)}; if another rank failed, its error "
            "is above; --debug shows this rank's traceback")


# -- missing collective: the backend lacks an operation (or a dtype) ---------------------------
def _missing_collective(exc: BaseException) -> tuple[str, str] | None:
    """(backend, operation) when a backend refused an operation it does not implement."""
    if not isinstance(exc, (RuntimeError, NotImplementedError)):
        return None
    line = first_line(exc)
    match = _MISSING_OP.search(line)
    if match:
        return match.group(1).lower(), match.group(2)
    match = _MISSING_DTYPE.search(line)
    if match:
        return match.group(1).lower(), f"{match.group(2)} on {match.group(3)}"
    return None


def _is_missing_collective(exc: BaseException, run: Run) -> bool:
    return _missing_collective(exc) is not None


def _missing_message(exc: BaseException, run: Run) -> str:
    backend, op = _missing_collective(exc) or ("?", "?")  # the predicate found them
    strategy = run.strategy.name if run.strategy else run.config.strategy
    return (f"the {backend} backend does not implement {op}, which the {strategy} strategy "
            "calls (use --backend gloo, or another strategy)")


# -- collective timeout: a collective waited out --timeout -------------------------------------
def _is_collective_timeout(exc: BaseException, run: Run) -> bool:
    """A collective that waited out ``--timeout``: told by type and origin, never by text.

    Gloo reports a timeout as a plain ``RuntimeError``; it counts when it was raised inside
    torch's collective code after the run had waited at least the timeout since its last step.
    """
    if run.world_size < 2:
        return False
    if isinstance(exc, TimeoutError):
        return True
    if isinstance(exc, _dist_error()):  # a store wait or a collective past --timeout
        return time.monotonic() - run.progress.step_started >= run.config.timeout * 0.9
    if not isinstance(exc, RuntimeError) or not _raised_in(exc, _COLLECTIVE_MODULES):
        return False
    return time.monotonic() - run.progress.step_started >= run.config.timeout * 0.9


def _timeout_message(exc: BaseException, run: Run) -> str:
    if not run.stash.get(TRAINING):
        return (f"rank {run.rank}: waited {run.config.timeout:g}s for the other ranks before "
                "training started: a rank is stuck before training (at import, in setup or "
                "loading data) or never started; see the other ranks' output, or change the "
                "limit with --timeout SECONDS or DISTRUN_TIMEOUT")
    return (f"rank {run.rank}: a collective timed out after {run.config.timeout:g}s: the ranks "
            "are out of step (a rank stopped calling collectives: stuck, or out of batches, "
            "which pip install distrun-join handles; under `distrun run` its stall line names "
            "the rank first, see --stall-timeout); change the limit with --timeout SECONDS or "
            "DISTRUN_TIMEOUT")


# -- lost connection: gloo's connection to a peer broke ----------------------------------------
def _is_lost_connection(exc: BaseException, run: Run) -> bool:
    """A collective whose connection to a peer broke (reset, closed): the peer's process or
    host is gone, or the network between them dropped. No local signal comes first when the
    peer was on another host, so this is told by gloo's own report of its transport."""
    return run.world_size > 1 and isinstance(exc, RuntimeError) \
        and _raised_in(exc, _LOOP_COLLECTIVE_MODULES) \
        and any(source in first_line(exc) for source in _TRANSPORT_SOURCES)


def _lost_connection_message(exc: BaseException, run: Run) -> str:
    line = first_line(exc)
    reason = line.split("]", 1)[-1].strip() if "]" in line else line
    return (f"rank {run.rank}: lost the connection to another rank at step "
            f"{run.progress.step} ({reason.split('. ')[0]}): its process or host stopped, or "
            "the network dropped; --debug shows this rank's traceback")


# -- lost peer: a collective failed because another rank stopped -------------------------------
def _is_lost_peer(exc: BaseException, run: Run) -> bool:
    """A collective that failed because another rank stopped, told by evidence, not text.

    When a rank fails, every launcher (distrun's, the elastic agent, torchrun) stops the others
    with SIGTERM. So a ``RuntimeError`` from collective code counts as a lost peer only once
    that signal arrived; an error of the rank's own (DDP's unused parameters...) gets no
    signal and keeps its traceback.
    """
    if run.world_size < 2 or not isinstance(exc, RuntimeError) \
            or not _raised_in(exc, _LOOP_COLLECTIVE_MODULES):
        return False
    deadline = time.monotonic() + _PEER_GRACE
    while run.stop_signal is None and time.monotonic() < deadline:
        time.sleep(0.02)  # the signal handler runs between these sleeps
    return run.stop_signal is not None


def _lost_peer_message(exc: BaseException, run: Run) -> str:
    return (f"rank {run.rank}: a collective failed at step {run.progress.step} because "
            f"another rank stopped (its error is above; --debug shows this rank's traceback): "
            f"{first_line(exc)}")


# -- stopped by the launcher: another rank failed ---------------------------------------------
def stopped_for_failure(run: Run, note: FailureNote) -> DistrunError:
    """What a rank ends with when its launcher stops it because rank ``note.rank`` failed
    (:mod:`distrun._launch.failure_note`): raised by its SIGTERM handler, mid-step."""
    return DistrunError(
        f"rank {run.rank}: stopped at step {run.progress.step} because rank {note.rank} failed "
        f"with exit code {note.code}{signal_note(note.code)}")


# -- helpers -----------------------------------------------------------------------------------
def _dist_error() -> type[BaseException]:
    import torch.distributed as dist

    return getattr(dist, "DistError", TimeoutError)


def _raised_in(exc: BaseException, prefixes: tuple[str, ...]) -> bool:
    """Whether a frame of ``exc``'s traceback runs code of a module named with ``prefixes``."""
    tb = exc.__traceback__
    while tb is not None:
        module = tb.tb_frame.f_globals.get("__name__", "")
        if module.startswith(prefixes):
            return True
        tb = tb.tb_next
    return False


#: the table, in the order it is tried (first match wins)
CASES: tuple[Case, ...] = (
    # DistNetworkError is a DistError: before the timeout case, which would take it late
    Case("network", _is_network_error, _network_message, DistrunError),
    # a backend lacking what the strategy calls is the user's choice of backend (exit 2)
    Case("missing-collective", _is_missing_collective, _missing_message, UsageError),
    # gloo's timeout text names its transport: before lost-connection, which reads that name
    Case("collective-timeout", _is_collective_timeout, _timeout_message, DistrunError),
    # a peer on another host sends no stop signal: told without lost-peer's wait for one
    Case("lost-connection", _is_lost_connection, _lost_connection_message, DistrunError),
    # waits up to _PEER_GRACE for the launcher's SIGTERM, so it is tried last
    Case("lost-peer", _is_lost_peer, _lost_peer_message, DistrunError),
)
