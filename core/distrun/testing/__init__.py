"""``distrun.testing``: a pytest plugin for distrun and for plugin authors.

Fixtures: ``distrun_pm`` (a fresh plugin manager, entry points off), ``distrun_cli`` (run the
``distrun`` command in a subprocess inside ``tmp_path``), ``distrun_hosts`` (a testbed of
network-namespace hosts, :mod:`distrun.testing.hosts`; its tests are marked ``multihost``).
Helpers: :func:`run_on_ranks` (a function on N real gloo ranks with a short timeout),
:func:`run_cli` and :func:`small_disk` (a real tmpfs of a given size: a full disk, met).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from distrun._launch.lifeline import die_with, die_with_parent
from distrun._launch.ports import free_port
from distrun._launch.reaper import descendants
from distrun.testing.disks import small_disk
from distrun.testing.hosts import HostSpec, Testbed, TestbedError, unavailable

__all__ = ["CliResult", "HostSpec", "Testbed", "backend_plugins", "busy_cores", "cpu_backends",
           "descendants", "distrun_cli", "distrun_hosts", "distrun_pm", "free_port", "imports_torch",
           "only_plugins", "run_cli", "run_on_ranks", "small_disk"]



MULTIHOST = ("multihost: runs on a testbed of network-namespace hosts (the distrun_hosts "
             "fixture); skipped where namespaces cannot be made")


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def __str__(self) -> str:  # shown by pytest when an assertion on the result fails
        return f"exit {self.returncode}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"


def imports_torch(*modules: str) -> bool:
    """Whether importing ``modules`` in a fresh interpreter imports torch (a plugin's entry
    point must not: ``distrun --help`` and the launcher stay torch-free)."""
    code = f"import sys, {', '.join(modules)}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    return out.stdout.strip() == "True"


def cpu_backends() -> dict[str, str | None]:
    """Every installed backend that serves CPU tensors: name -> why it cannot run here (or None).

    gloo first, then the others by name: the order a backend matrix runs in.
    """
    from distrun._registry.collect import collect_backends
    from distrun._registry.manager import make_plugin_manager

    offered = {n: i for n, i in collect_backends(make_plugin_manager()).items()
               if "cpu" in i.devices}
    return {n: offered[n].unavailable() for n in sorted(offered, key=lambda n: (n != "gloo", n))}


def backend_plugins(backend: str | None = None) -> list[str]:
    """Modules of the installed plugins that offer the backends ``backend`` names.

    ``backend`` defaults to ``$DISTRUN_BACKEND``. For a test that loads only some plugins
    (``DISTRUN_DISABLE_PLUGIN_AUTOLOAD=1`` and ``DISTRUN_PLUGINS``): add these to the list so
    the run still finds its backend.
    """
    from importlib.metadata import entry_points

    from distrun._registry.manager import ENTRY_POINT_GROUP
    from distrun._spec.backends import BackendInfo, parse_backend

    wanted = set(parse_backend(backend or os.environ.get("DISTRUN_BACKEND", "auto")).values())
    out = []
    for entry in entry_points(group=ENTRY_POINT_GROUP) if wanted else ():
        plugin = entry.load()
        register = getattr(plugin, "distrun_register_backends", None)
        if register is None:
            continue
        offered: list[BackendInfo] = []
        register(register=offered.append)
        if wanted & {info.name for info in offered}:
            out.append(plugin.__name__)
    return out


def only_plugins(modules: str) -> None:
    """Run this process's next fits with only the plugin ``modules`` (comma-separated), plus
    those offering ``$DISTRUN_BACKEND``'s backends: every Trainer builds its own manager from
    these settings (entry points off, ``DISTRUN_PLUGINS``)."""
    from distrun._registry.manager import AUTOLOAD_ENV, EXTRA_ENV

    os.environ[AUTOLOAD_ENV] = "1"
    os.environ[EXTRA_ENV] = ",".join([modules, *backend_plugins()])


def run_cli(*args: str, cwd: str | os.PathLike | None = None, env: dict[str, str] | None = None,
            timeout: float = 300.0, input: str | None = None) -> CliResult:
    """Run ``distrun ARGS`` as a user would, in a subprocess; never raises on a bad exit.

    The launcher dies with this process however it ends (its workers die with it).
    """
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-m", "distrun", *args], cwd=cwd, env=full_env, text=True,
        capture_output=True, timeout=timeout, input=input, preexec_fn=die_with_parent(),
    )
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


#: what the server that forks the ranks of :func:`run_on_ranks` imports once (what every rank
#: imports; torch's optimizers import torch._dynamo): a rank then starts in milliseconds instead
#: of importing torch again
RANK_PRELOAD = ["torch", "torch.distributed", "torch.nn", "torch.optim", "torch._dynamo",
                "distrun", "distrun._train.trainer"]


def _rank_context() -> Any:
    """The multiprocessing context of :func:`run_on_ranks`: a fork server that has imported
    :data:`RANK_PRELOAD` (it starts once per test process, before any rank needs it)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_PRELOAD)
    return ctx


def _die_with(pid: int) -> None:
    """SIGKILL this rank when process ``pid`` (the test process: not its parent, the fork
    server is) ends, however it ends; now if it has ended already."""
    die_with(os.getppid())  # the fork server, should it go first
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)
        return

    def watch() -> None:
        select.select([fd], [], [])  # readable once the process has ended
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="die-with-test-process", daemon=True).start()


def _stdio_of(pid: int) -> None:
    """Write to the standard output and error that process ``pid`` has now (a forked rank
    has the fork server's, which are what the test process had when the server started)."""
    for fd in (1, 2):
        try:
            new = os.open(f"/proc/{pid}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        except OSError:  # a socket, or no /proc: keep the server's
            continue
        sys.stdout.flush() if fd == 1 else sys.stderr.flush()
        os.dup2(new, fd)
        os.close(new)


def _rank_main(fn: Callable[..., Any], rank: int, world: int, port: int, init: bool,
               timeout: float, args: Sequence[Any], queue: Any, backend: str = "gloo",
               parent: int = 0, environ: dict[str, str] | None = None) -> None:
    if parent:  # a rank (rank 0 hosts the store) ends with the test process, however it ends
        _die_with(parent)
    if environ is not None:  # the test process's environment now, not the fork server's
        os.environ.clear()
        os.environ.update(environ)
    if parent:
        _stdio_of(parent)
    os.environ.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1", "DISTRUN_TIMEOUT": str(int(timeout)),
        "DISTRUN_BACKEND": backend,  # a Trainer inside makes its group with it
    })
    try:
        import torch

        torch.set_num_threads(1)
        if init:
            import datetime

            import torch.distributed as dist

            from distrun._config.run_config import RunConfig
            from distrun._strategies.process_group import prepare_backend

            # a plugin's backend is checked and loaded as a run would (gloo: nothing to do)
            name = prepare_backend(RunConfig(backend=backend), "cpu")
            dist.init_process_group(name, rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=timeout))
        result = fn(rank, world, *args)
        # Plain pickle bytes: torch's shared-memory queue reduction can hang once the
        # sending process exits.
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if init:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any,
                 init_process_group: bool = False, timeout: float = 120.0,
                 backend: str = "gloo") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; their results.

    Each process gets torchrun's variables (so a ``Trainer`` inside sets up the group itself),
    or a ready group of ``backend`` (any ``--backend`` value) with ``init_process_group=True``.
    ``fn`` must be importable (module level). A rank that raises fails the call with its
    traceback; a hang fails after ``timeout`` seconds (and collectives time out at the same
    bound). Each rank is forked from a server that has imported torch once
    (:data:`RANK_PRELOAD`), and gets this process's environment, working directory and
    standard streams as they are at the call.
    """
    ctx = _rank_context()
    queue = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, port, init_process_group,
                                                   timeout, args, queue, backend, os.getpid(),
                                                   environ),
                         daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    reported: set[int] = set()
    first_error = float("inf")
    try:
        deadline = time.monotonic() + timeout + 30
        while len(reported) < world_size:
            if errors and time.monotonic() > min(deadline, first_error + 10.0):
                break  # a rank failed: the others get a moment to report, not a full timeout
            try:
                rank, ok, value = queue.get(timeout=0.5)
            except queue_mod.Empty:
                missing = sorted(set(range(world_size)) - set(results) - reported)
                dead = [r for r in missing if procs[r].exitcode is not None]
                if dead:
                    # A rank that died without reporting (crash at import, os._exit, kill).
                    time.sleep(1.0)  # let a result already in flight arrive first
                    if queue.empty():
                        errors.append(f"ranks {dead} exited with codes "
                                      f"{[procs[r].exitcode for r in dead]} without a result")
                        break
                if time.monotonic() > deadline:
                    errors.append(f"timed out after {timeout}s waiting for ranks {missing}")
                    break
                continue
            reported.add(rank)
            if ok:
                results[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank} failed:\n{value}")
                first_error = min(first_error, time.monotonic())
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]


@pytest.fixture
def distrun_pm(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fresh plugin manager (built-ins only, no entry points); for the test, the managers
    Trainers build in this process load no entry points either (pass this one as
    ``Trainer(plugin_manager=distrun_pm)`` to share its plugins)."""
    from distrun._registry.manager import AUTOLOAD_ENV, make_plugin_manager

    monkeypatch.setenv(AUTOLOAD_ENV, "1")
    return make_plugin_manager(autoload=False)


@pytest.fixture
def distrun_cli(tmp_path: Any) -> Callable[..., CliResult]:
    """``distrun_cli("run", "train.py")`` runs the command in ``tmp_path``."""

    def call(*args: str, **kwargs: Any) -> CliResult:
        kwargs.setdefault("cwd", tmp_path)
        return run_cli(*args, **kwargs)

    return call


@pytest.fixture
def busy_cores() -> Iterator[int]:
    """One CPU-bound process per core while the test runs; yields their count.

    Signal, stop and process-lifecycle tests run under it: races that a quiet machine hides
    (a rank seeing a stop request a step late, a worker outliving its launcher) show under load.
    """
    count = os.cpu_count() or 1
    # they never end by themselves: tied to this process, however it ends
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                             preexec_fn=die_with_parent())
            for _ in range(count)]
    try:
        yield count
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MULTIHOST)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that uses ``distrun_hosts`` is a ``multihost`` test, marked or not."""
    for item in items:
        if "distrun_hosts" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.multihost)


@pytest.fixture
def distrun_hosts() -> Iterator[Callable[..., Testbed]]:
    """``bed = distrun_hosts(2)`` (or a list of :class:`HostSpec`): a testbed of namespace
    hosts (:mod:`distrun.testing.hosts`), removed with every process on it when the test ends,
    passed, failed or interrupted. Skips the test, saying why, where namespaces cannot be made.
    """
    why = unavailable()
    if why:
        pytest.skip(f"multihost testbed unavailable: {why}")
    beds: list[Testbed] = []

    def make(hosts: int | Sequence[HostSpec] = 2) -> Testbed:
        beds.append(Testbed.up(hosts))
        return beds[-1]

    try:
        yield make
    finally:
        problems = []
        for bed in beds:
            try:
                bed.down()
            except TestbedError as exc:
                problems.append(str(exc))
        if problems:
            pytest.fail("; ".join(problems))
