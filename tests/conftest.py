"""Fixtures shared by every test folder.

``cli`` runs the ``distrun`` command *in this process* through click's ``CliRunner``: for
everything that needs no separate process (option parsing, usage errors, ``plugins`` and
``strategies``, ``config show/init``, ``--help``, argument errors of ``plot`` and ``ckpt``).
Launching, signals and exit codes of real runs keep using :func:`distrun.testing.run_cli`
(a ``distrun`` subprocess).

``cpu_backend`` is the backend matrix: a test (or a module fixture) that takes it runs once
per CPU backend chosen with ``--backends`` and is marked ``backend`` (and ``slow`` for every
backend but gloo). The default suite (CI's) runs the matrix over gloo; ``tox -e backend-shm``
(``--backends shm``) runs it over the shared-memory backend, ``--backends available`` over
every installed one that can run here (gloo, and shm when distrun-shm is installed).
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest
from click.testing import CliRunner

from distrun.testing import CliResult

_REAL_POPEN = subprocess.Popen
_LAUNCH = ("an in-process `cli(...)` call tried to start a worker: use distrun.testing.run_cli "
           "for anything that launches")


def _no_worker_process(*args: object, **kwargs: object) -> None:
    raise AssertionError(_LAUNCH)


def _popen_but_no_python(cmd: object, *args: object, **kwargs: object) -> subprocess.Popen:
    """Helpers such as ``uname`` (``platform``) may run; a Python worker may not."""
    argv = [cmd] if isinstance(cmd, (str, bytes, os.PathLike)) else list(cmd)  # type: ignore
    if argv and (os.path.basename(str(argv[0])).startswith("python")
                 or argv[0] == sys.executable):
        raise AssertionError(_LAUNCH)
    return _REAL_POPEN(cmd, *args, **kwargs)


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., CliResult]]:
    """``cli("config", "show", cwd=tmp_path, env={...})``: ``distrun ARGS`` run in-process.

    Same result shape as ``run_cli`` (``returncode``, ``stdout``, ``stderr``, ``output``): the
    exit code is the ``SystemExit`` code of ``distrun._cli.main.main``, stdout and stderr are
    captured separately by ``CliRunner``. ``env`` is applied for the call only (``None`` values
    unset a variable), ``cwd`` too. An unexpected exception propagates and fails the test. The
    call may not start a Python process (that is a launch: use ``run_cli``).
    """
    from distrun._cli.main import main

    runner = CliRunner()

    def invoke(*args: str, cwd: str | os.PathLike | None = None,
               env: dict[str, str | None] | None = None, input: str | None = None) -> CliResult:
        code: int = 0
        with contextlib.ExitStack() as stack:
            if cwd is not None:
                stack.enter_context(contextlib.chdir(cwd))
            guard = stack.enter_context(monkeypatch.context())
            guard.setattr(subprocess, "Popen", _popen_but_no_python)
            guard.setattr(multiprocessing.process.BaseProcess, "start", _no_worker_process)
            out, err, _ = stack.enter_context(runner.isolation(input=input, env=env))
            try:
                main(list(args))
            except SystemExit as exc:
                if exc.code is None:
                    code = 0
                elif isinstance(exc.code, int):
                    code = exc.code
                else:  # sys.exit("message"): the interpreter prints it and exits 1
                    print(exc.code, file=sys.stderr)
                    code = 1
            finally:
                sys.stdout.flush()  # the runner's text wrappers buffer
                sys.stderr.flush()
            stdout, stderr = out.getvalue().decode(), err.getvalue().decode()
        return CliResult(code, stdout, stderr)

    yield invoke


#: folders whose conftest builds a session fixture (a Ray cluster, the elastic tests'
#: reference run, the shm extension) or checks /dev/shm after each test (a segment another
#: worker's shm run has not yet removed would be blamed on it): under pytest-xdist each runs on
#: one worker
_ONE_WORKER_FOLDERS = ("tests/contrib/ray", "tests/contrib/shm", "tests/plugins/elastic")


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``-n``, with ``--dist loadgroup``): the tests of one file run on one
    worker (module fixtures are built once), those of a folder in :data:`_ONE_WORKER_FOLDERS`
    too."""
    root = config.rootpath
    for item in items:
        path = item.path.relative_to(root).as_posix()
        group = next((f for f in _ONE_WORKER_FOLDERS if path.startswith(f + "/")), path)
        item.add_marker(pytest.mark.xdist_group(group))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--backends", default="gloo",
                     help="CPU backends for the tests that take cpu_backend: names (gloo,shm; "
                          "default gloo) or 'available' (every installed one that can run "
                          "here)")


def _cpu_backends(option: str) -> list[object]:
    from distrun.testing import cpu_backends

    offered = cpu_backends()
    if option != "available":
        names = [n.strip() for n in option.split(",") if n.strip()]
        unknown = sorted(set(names) - set(offered))
        if unknown:
            raise pytest.UsageError(f"--backends: {', '.join(unknown)} not installed "
                                    f"(installed CPU backends: {', '.join(offered)})")
    else:
        names = list(offered)
    out: list[object] = []
    for name in names:
        reason = offered[name]
        if reason is None:
            # the fast lane runs the matrix over gloo; the full suite over every backend
            marks = [pytest.mark.backend] + ([pytest.mark.slow] if name != "gloo" else [])
            out.append(pytest.param(name, marks=marks))
        elif option != "available":  # asked for by name: say why it does not run
            out.append(pytest.param(name, marks=[pytest.mark.backend, pytest.mark.skip(
                reason=f"backend {name}: {reason}")]))
    return out


_BACKENDS: dict[str, list[object]] = {}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "cpu_backend" in metafunc.fixturenames:
        option = metafunc.config.getoption("--backends")
        if option not in _BACKENDS:
            _BACKENDS[option] = _cpu_backends(option)
        # module scope: a module fixture that takes it runs once per backend
        metafunc.parametrize("cpu_backend", _BACKENDS[option], scope="module")


@pytest.fixture(scope="session", autouse=True)
def no_testbed_left() -> Iterator[None]:
    """Testbeds of network-namespace hosts (distrun.testing.hosts): what killed runs left is
    swept first; after the suite none of ours is left (namespace, hosts file or process)."""
    from distrun.testing.hosts import leftovers, sweep

    sweep()
    yield
    left = leftovers()
    assert not left, f"testbed leftovers (ip netns list; /etc/netns): {left}"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """After the suite, /dev/shm holds no segment of distrun-shm whose process has ended (a
    live one belongs to a run still going, e.g. another session's tests). Under pytest-xdist
    the controller checks, once every worker is done: a worker that finished early would
    blame a segment another worker's test has yet to remove."""
    if hasattr(session.config, "workerinput"):
        return
    try:
        from distrun_shm.backend import leftover_segments
    except ImportError:
        return
    left = leftover_segments()
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        line = f"segments of ended processes left in /dev/shm: {left}"
        if reporter is not None:
            reporter.write_line(f"ERROR: {line}", red=True)
        else:
            print(f"ERROR: {line}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED



@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One torch.compile cache for the session's --compile tests (inductor's FX graph and AOT
    autograd caches, triton's): what one test compiled, the next loads. The environment to
    hand their processes (``run_cli(..., env=compile_cache)``; ``compile_env`` sets it)."""
    root = tmp_path_factory.mktemp("compile-cache")
    return {"TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
            "TRITON_CACHE_DIR": str(root / "triton")}


@pytest.fixture
def compile_env(compile_cache: dict[str, str],
                monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The session's compile cache set in this test's environment (the processes
    ``run_on_ranks`` spawns inherit it), and inductor compiling in the process itself: a pool
    of compile workers (each importing torch) costs more than the few kernels of a test
    model on a busy machine."""
    for name, value in compile_cache.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    return compile_cache
