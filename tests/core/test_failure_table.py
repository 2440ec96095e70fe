"""The failure table (``distrun._train.failures``): each case, told from what torch raises.

Every case of ``CASES`` has a builder here (a new case without one fails
``test_every_case_has_a_builder``). A builder makes the exception the way torch makes it: a
real call on a one-rank gloo group or a real TCPStore where one process can raise it, and
otherwise torch's own type and text, raised from a function of the module the predicate looks
for (the error of a peer needs a second process). ``run`` is a small stand-in holding only what
the predicates and messages read.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from distrun._spec.errors import DistrunError, UsageError
from distrun._spec.stash import Stash
from distrun._train import failures
from distrun._train.failures import CASES, TRAINING, classify
from distrun._train.run import Progress


@dataclass
class _Config:
    timeout: float = 30.0
    strategy: str = "ddp"


@dataclass
class _Run:
    """What the predicates and messages read of a :class:`distrun._train.run.Run`."""

    world_size: int = 2
    rank: int = 0
    config: _Config = field(default_factory=_Config)
    strategy: Any = None
    stop_signal: int | None = None
    progress: Progress = field(default_factory=lambda: Progress(step=7))
    stash: Stash = field(default_factory=Stash)


@dataclass
class _Built:
    exc: BaseException
    run: _Run
    error: type[DistrunError]
    exit_code: int
    message: str


def _raised(call: Callable[[], object]) -> BaseException:
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - the exception is what the test is about
        return exc
    raise AssertionError(f"{call} did not raise")


def _raised_in(module: str, exc: BaseException) -> BaseException:
    """``exc`` raised by a function of ``module``, as torch's code raises a peer's failure."""
    namespace: dict[str, Any] = {"__name__": module}
    exec("def collective(exc):\n    raise exc\n", namespace)  # noqa: S102 - a fixed text
    return _raised(lambda: namespace["collective"](exc))


@contextmanager
def _one_rank_gloo(timeout: float) -> Iterator[None]:
    """This process as the one rank of a gloo group whose collectives wait ``timeout`` s."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timedelta(seconds=timeout))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _network(monkeypatch: pytest.MonkeyPatch) -> _Built:
    """The store's server went away: the client's next request finds the connection closed."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=5))
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False,
                           timeout=timedelta(seconds=5))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    client.set("key", "value")
    del server  # its last reference: the server closes its sockets
    exc = _raised(lambda: client.get("key"))
    assert isinstance(exc, dist.DistNetworkError), exc
    line = str(exc).splitlines()[0].strip()
    return _Built(exc, _Run(), DistrunError, 1, (
        f"rank 0: a network error with the other ranks or the store at 127.0.0.1:{client.port} "
        f"(step 7): {line}; if another rank failed, its error is above; --debug shows this "
        "rank's traceback"))


def _missing_collective(monkeypatch: pytest.MonkeyPatch) -> _Built:
    """gloo has no ``suspend``: c10d's own refusal ("Backend gloo does not support suspend")."""
    with _one_rank_gloo(timeout=5):
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))
        exc = _raised(backend.suspend)
    return _Built(exc, _Run(strategy=SimpleNamespace(name="ddp")), UsageError, 2,
                  "the gloo backend does not implement suspend, which the ddp strategy calls "
                  "(use --backend gloo, or another strategy)")


def _collective_timeout(monkeypatch: pytest.MonkeyPatch) -> _Built:
    """A receive nobody sends to: gloo gives up after the group's timeout."""
    run = _Run(config=_Config(timeout=0.3))
    run.stash[TRAINING] = True
    with _one_rank_gloo(timeout=0.3):
        run.progress.step_started = time.monotonic()
        exc = _raised(lambda: dist.recv(torch.zeros(1)))  # from any rank: none sends
    return _Built(exc, run, DistrunError, 1, (
        "rank 0: a collective timed out after 0.3s: the ranks are out of step (a rank stopped "
        "calling collectives: stuck, or out of batches, which pip install distrun-join "
        "handles; under `distrun run` its stall line names the rank first, see "
        "--stall-timeout); change the limit with --timeout SECONDS or DISTRUN_TIMEOUT"))


def _lost_connection(monkeypatch: pytest.MonkeyPatch) -> _Built:
    """gloo's report of a peer closing its connection, from c10d's collective code."""
    exc = _raised_in("torch.distributed.distributed_c10d", RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:538] Connection "
        "closed by peer [10.0.0.2]:41234"))
    return _Built(exc, _Run(), DistrunError, 1, (
        "rank 0: lost the connection to another rank at step 7 (Connection closed by peer "
        "[10.0.0.2]:41234): its process or host stopped, or the network dropped; --debug "
        "shows this rank's traceback"))


def _lost_peer(monkeypatch: pytest.MonkeyPatch) -> _Built:
    """The shm backend's report of a rank that exited, in the loop's step sync, after the
    launcher's SIGTERM arrived."""
    exc = _raised_in("distrun._train.step_sync", dist.DistBackendError(
        "shm backend: rank 1 of the group (pid 4242) exited during allreduce"))
    return _Built(exc, _Run(stop_signal=signal.SIGTERM), DistrunError, 1, (
        "rank 0: a collective failed at step 7 because another rank stopped (its error is "
        "above; --debug shows this rank's traceback): shm backend: rank 1 of the group "
        "(pid 4242) exited during allreduce"))


#: one builder per case of the table, by the case's name
BUILDERS: dict[str, Callable[[pytest.MonkeyPatch], _Built]] = {
    "network": _network,
    "missing-collective": _missing_collective,
    "collective-timeout": _collective_timeout,
    "lost-connection": _lost_connection,
    "lost-peer": _lost_peer,
}


def test_every_case_has_a_builder() -> None:
    names = [case.name for case in CASES]
    assert len(set(names)) == len(names)  # a name says which case matched
    assert set(BUILDERS) == set(names)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_each_case_tells_its_exception_as_one_line(case: failures.Case,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    built = BUILDERS[case.name](monkeypatch)
    assert case.matches(built.exc, built.run)
    error = classify(built.exc, built.run)
    assert type(error) is case.error is built.error
    assert error.exit_code == built.exit_code
    assert str(error) == built.message
    assert "\n" not in str(error)


def test_a_timeout_before_training_says_a_rank_is_stuck_before_training() -> None:
    run = _Run(config=_Config(timeout=0.2))  # the loop has not started: TRAINING unset
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=0.2))
    run.progress.step_started = time.monotonic()
    exc = _raised(lambda: store.wait(["rank-1-ready"]))  # a store wait past the timeout
    error = classify(exc, run)
    assert type(error) is DistrunError
    assert str(error) == (
        "rank 0: waited 0.2s for the other ranks before training started: a rank is stuck "
        "before training (at import, in setup or loading data) or never started; see the other "
        "ranks' output, or change the limit with --timeout SECONDS or DISTRUN_TIMEOUT")


def test_a_dtype_the_backend_lacks_is_named_with_the_operation() -> None:
    exc = RuntimeError("shm backend: allreduce does not support dtype UInt32 (float32, "
                       "float64, bfloat16, float16, int8/16/32/64, uint8, bool)")
    error = classify(exc, _Run())
    assert type(error) is UsageError
    assert str(error) == ("the shm backend does not implement allreduce on dtype UInt32, which "
                          "the ddp strategy calls (use --backend gloo, or another strategy)")


def test_the_first_matching_case_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    """gloo's timeout names its transport's source file, so lost-connection accepts it too."""
    built = _collective_timeout(monkeypatch)
    built.run.stop_signal = signal.SIGTERM  # lost-peer would accept it as well, at once
    assert [case.name for case in CASES if case.matches(built.exc, built.run)] == \
        ["collective-timeout", "lost-connection", "lost-peer"]
    assert str(classify(built.exc, built.run)) == built.message


def test_an_error_of_user_code_is_left_as_it_is() -> None:
    assert classify(_raised(lambda: int("x")), _Run(stop_signal=signal.SIGTERM)) is None


def test_an_error_of_the_ranks_own_in_collective_code_keeps_its_traceback(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A collective that failed without the launcher's stop signal: not a lost peer."""
    monkeypatch.setattr(failures, "_PEER_GRACE", 0.2)
    with _one_rank_gloo(timeout=5):
        exc = _raised(lambda: dist.all_reduce(torch.ones(2, dtype=torch.uint32)))
    assert isinstance(exc, RuntimeError) and "Invalid scalar type" in str(exc), exc
    assert classify(exc, _Run()) is None
