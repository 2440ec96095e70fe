"""``python -m distrun._worker.main``: the entry point of every worker ``distrun run`` starts.

    python -m distrun._worker.main pkg.module:Task [ARGS]   a task, trained by the core's loop
    python -m distrun._worker.main --script PATH [ARGS]     a script, exactly as ``python PATH``
    python -m distrun._worker.main --module NAME [ARGS]     a module, as ``python -m NAME``

Around the target the worker ties itself to its launcher (:mod:`distrun._launch.lifeline`: it
dies within a moment of the launcher's death, however that dies), serves the rendezvous store
on the socket the launcher bound when it is rank 0 (:mod:`distrun._worker.store`), and it
ends the process the way the interpreter would but without finalizing it: threading's exit
callbacks run (they stop idle pool threads), non-daemon threads are joined, the exit handlers
run (one of them destroys a process group the target left initialized), every open file is
flushed, and then the process exits with the target's code.

Why: a gloo worker thread releases each finished collective a moment after the caller saw it
finish. If that release drops the last reference to a tensor Python created, it needs the GIL,
and during interpreter finalization a thread that asks for the GIL is ended, which in a C++
destructor aborts the process ("terminate called without an active exception", exit 134). A
core dump shows exactly that (the main thread in ``Py_FinalizeEx``'s garbage collection, a
``ProcessGroupGloo::runLoop`` thread in ``~AsyncAllreduceWork`` waiting for the GIL). It
happened in a few percent of 2-rank runs under load, under torchrun too; destroying the group
does not stop it, since DDP keeps the group alive. Not finalizing does.
Importing this module does not import torch.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import gc
import io
import logging
import os
import runpy
import signal
import sys
import threading
import traceback
import types
import weakref
import zipfile
from _io import _IOBase  # the C base of every file object (io.IOBase is an ABC over it)
from importlib.machinery import SourceFileLoader
from itertools import compress
from typing import Any, NoReturn

from distrun._launch.lifeline import die_with_launcher
from distrun._spec.errors import DistrunError
from distrun._worker.store import host_launcher_store

__all__ = ["destroy_leftover_group", "finish", "main"]

_USAGE = ("usage: python -m distrun._worker.main (pkg.module:Task | --script PATH | "
          "--module NAME) [ARGS]")


def destroy_leftover_group() -> None:
    """Destroy the default process group if it is still initialized (local: no collective)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return  # the target never touched torch.distributed
    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - exiting anyway; the exit code stays the target's
        pass


def _flush_open_files() -> None:
    """Flush every open writable file object: finalization would have closed them.

    Every file object's class derives from ``_io._IOBase`` (``io.IOBase`` is an abstract
    class over it). The ~290,000 objects of a process that imported torch are sifted in C
    (``compress`` over the type checks, 0.02 s; a loop in Python took 0.03-0.07 s, and the
    check of ``io.IOBase`` through ``ABCMeta.__subclasscheck__``, which caches each new class,
    0.13-0.16 s), at every worker's exit, the survivors' of a failed rank too, before a
    restart."""
    objects = gc.get_objects()
    # type(): never an object's own __class__
    for obj in compress(objects, map(_IOBase.__subclasscheck__, map(type, objects))):
        try:
            if not obj.closed and obj.writable():
                obj.flush()
        except Exception:  # noqa: BLE001 - a broken stream must not block the others
            pass


def _skip_idle_exit_work() -> None:
    """Take out two of torch's exit handlers whose work nothing outlives the process to see.

    torch's operator libraries unregister their operators at exit (a finalizer each, 174
    after ``import torch``: 0.02 s), and torch._dynamo formats a table of its compile times
    for a log line at INFO, importing ``tabulate`` to do it, also when that log is off
    (0.02 s). Both run at every worker's exit, before a restart can start the next
    workers."""
    library = sys.modules.get("torch.library")
    registry = getattr(weakref.finalize, "_registry", None)
    if library is not None and isinstance(registry, dict):
        unregister = getattr(library, "_del_library", None)
        for finalizer, info in list(registry.items()):
            if getattr(info, "func", None) is unregister:
                finalizer.atexit = False
    utils = sys.modules.get("torch._dynamo.utils")
    log = getattr(utils, "log", None)
    dump = getattr(utils, "dump_compile_times", None)
    if log is not None and dump is not None and not log.isEnabledFor(logging.INFO):
        atexit.unregister(dump)


def _exit_code(exc: SystemExit) -> int:
    """What the interpreter would exit with for ``exc`` (printing a message code, as it does)."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _shutdown_threads() -> None:
    """What the interpreter does first at exit: ``threading._shutdown``.

    It runs the threading module's exit callbacks (``threading._register_atexit``, newest
    first), then joins every non-daemon thread, also those started meanwhile. The callbacks
    come first because they are what ends idle threads: ``concurrent.futures`` tells its
    pool threads to stop there, so joining them before it would wait forever (a
    ``ThreadPoolExecutor`` kept alive by a library, as torch.compile's is).
    """
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is None or threading.current_thread() is not threading.main_thread():
        # not CPython's threading module: join as it documents, with no callbacks to run
        current = threading.current_thread()
        for thread in threading.enumerate():
            if thread is not current and not thread.daemon:
                thread.join()
        return
    try:
        shutdown()
    except BaseException:  # noqa: BLE001 - as the interpreter reports it, then goes on exiting
        print(f"Exception ignored in: {threading!r}", file=sys.stderr)
        traceback.print_exc()


def finish(code: int) -> NoReturn:
    """End this process as the interpreter would at exit, without finalizing it (see above).

    In the interpreter's order (``Py_FinalizeEx``): threading's shutdown (its exit callbacks,
    then the non-daemon threads joined), then the :mod:`atexit` handlers, newest first, then
    the standard streams flushed; then, instead of finalizing, ``os._exit``.
    """
    _shutdown_threads()
    _skip_idle_exit_work()
    # The interpreter runs these at exit; it is what skipping finalization must keep (the
    # user's handlers, logging's shutdown, multiprocessing's clean-up, our group teardown).
    atexit._run_exitfuncs()
    _flush_open_files()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _run_as_main(run: str, name: str) -> None:
    """Run a script or module as ``__main__``, as ``python PATH`` / ``python -m NAME`` would.

    A script's ``__file__`` is absolute (as Python gives it since 3.9); ``sys.argv[0]`` stays
    as the user typed it (``runpy.run_path`` would make the two the same). An uncaught error goes to ``sys.excepthook`` (the script's own, or
    torch's, which prefixes ``[rankN]:``), minus this wrapper's frames, as the interpreter
    reports it.
    """
    try:
        if run == "--script" and os.path.isfile(name) and not zipfile.is_zipfile(name):
            _run_file(name)
        elif run == "--script":  # a folder or zip with a __main__.py
            runpy.run_path(name, run_name="__main__")
        else:
            runpy.run_module(name, run_name="__main__", alter_sys=True)
    except SystemExit:
        raise
    except BaseException as exc:  # Ctrl-C's KeyboardInterrupt too, as Python reports it
        tb = exc.__traceback__
        # by file, not __name__: under `python -m distrun._worker.main` this module's and the
        # user's script's frames are both "__main__"
        while tb is not None and tb.tb_frame.f_code.co_filename in (
                __file__, runpy.__file__, "<frozen runpy>"):
            tb = tb.tb_next
        _report_uncaught(type(exc), exc.with_traceback(tb), tb)
        raise SystemExit(128 + signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1) \
            from None


def _run_file(name: str) -> None:
    """Run the file ``name`` as ``python name`` does: ``__main__`` in ``sys.modules`` (so
    ``pickle`` and spawned children find it), an absolute ``__file__``, ``__spec__`` None."""
    path = os.path.abspath(name)
    with io.open_code(path) as fh:
        code = compile(fh.read(), path, "exec", dont_inherit=True)
    module = types.ModuleType("__main__")
    module.__file__ = path
    module.__loader__ = SourceFileLoader("__main__", path)
    module.__builtins__ = builtins  # type: ignore[attr-defined]
    sys.modules["__main__"] = module
    exec(code, module.__dict__)


def _report_uncaught(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
    """What the interpreter does with an uncaught error: ``sys.excepthook``, and when the
    hook itself fails, both tracebacks (CPython's "Error in sys.excepthook")."""
    try:
        sys.excepthook(kind, exc, tb)
    except BaseException as hook_exc:  # noqa: BLE001 - reported as the interpreter does
        print("Error in sys.excepthook:", file=sys.stderr)
        traceback.print_exception(type(hook_exc), hook_exc, hook_exc.__traceback__)
        print("\nOriginal exception was:", file=sys.stderr)
        traceback.print_exception(kind, exc, tb)
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] in ("--script", "--module") and len(argv) < 2):
        print(_USAGE, file=sys.stderr)
        raise SystemExit(2)
    try:
        _run(argv)
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 128 + signal.SIGINT
    except BaseException:  # as the interpreter reports an uncaught error
        traceback.print_exc()
        code = 1
    finish(code)


def _prepare_backend() -> None:
    """Load the plugin backend ``--backend`` names before a plain script starts.

    The script's own ``init_process_group("shm")`` then finds it, and ``init_process_group()``
    with no backend named uses it (for its devices): the script runs unchanged.
    """
    import dataclasses
    import json

    from distrun._config.run_config import CONFIG_ENV, RunConfig

    value = os.environ.get("DISTRUN_BACKEND", "auto")
    if os.environ.get(CONFIG_ENV):  # the launcher's resolved value
        value = json.loads(os.environ[CONFIG_ENV])["values"].get("backend", value)
    if value in ("", "auto"):
        return
    from distrun._strategies.process_group import prepare_backend

    try:
        prepare_backend(dataclasses.replace(RunConfig(), backend=value))
    except DistrunError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(exc.exit_code) from None


def _record_position(script: bool) -> None:
    """Keep this rank's position where its launcher reads it, dump its stacks on request,
    and mark its collectives (:mod:`distrun._diagnose`); nothing when the launcher is not
    distrun's (no positions folder named) or ``--stall-timeout 0`` turned it off."""
    import json

    from distrun._config.run_config import CONFIG_ENV
    from distrun._diagnose.position import Phase, start_recorder

    try:  # --stall-timeout 0: no watcher, and nothing kept for it
        if json.loads(os.environ.get(CONFIG_ENV) or "{}").get("values", {}).get(
                "stall_timeout") == 0:
            return
    except (ValueError, AttributeError):
        pass
    rec = start_recorder(int(os.environ.get("RANK", "0") or 0))
    if rec is None:
        return
    from distrun._diagnose.stacks import arm
    from distrun._diagnose.torch_calls import watch_collectives

    arm(os.path.dirname(rec.path), rec.rank, rec)
    watch_collectives(rec, script_steps=script)
    from distrun._diagnose.exchange import serve_exchange

    serve_exchange(os.path.dirname(rec.path), rec.rank)  # (several nodes only)
    rec.phase(Phase.SCRIPT if script else Phase.SETUP)


def _run(argv: list[str]) -> None:
    die_with_launcher()
    host_launcher_store()  # rank 0: the store on the socket the launcher bound
    _record_position(script=argv[0] in ("--script", "--module"))
    # Registered first, so it runs last: after the target's own exit handlers.
    atexit.register(destroy_leftover_group)
    if argv[0] in ("--script", "--module"):
        run, name, args = argv[0], argv[1], argv[2:]
        sys.argv = [name, *args]
        # what `python PATH` / `python -m NAME` put first on sys.path
        sys.path[0] = os.path.dirname(os.path.abspath(name)) if run == "--script" \
            else os.getcwd()
        _prepare_backend()
        _run_as_main(run, name)
        return
    target, args = argv[0], argv[1:]
    sys.argv = [target, *args]
    try:
        from distrun._train.task import load_task

        task = load_task(target)
    except DistrunError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(exc.exit_code) from None
    from distrun._train.trainer import Trainer

    Trainer().fit(task)


if __name__ == "__main__":
    main()
