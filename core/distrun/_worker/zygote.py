"""``python [FLAGS] -m distrun._worker.zygote FD``: a warm spare that forks workers on request.

A restart's cost is almost all in starting Python and importing torch. A launcher that restarts
workers (distrun-elastic's agent) starts one of these per local rank, with the interpreter flags,
the environment and the working directory the worker would get. It imports torch (and the
worker's own entry point) once, while it is still the only thread of its process, and then
waits on the launcher's socket ``FD``. Asked to, it forks: the child takes the request's exact
environment, working directory, standard streams and command line, becomes a session leader,
and runs :mod:`distrun._worker.main` as ``__main__``, exactly as ``python -m
distrun._worker.main ARGS`` would. The zygote stays, idle, for the next request; it reports each
child's exit status (``os.waitpid``'s, as ``Popen.returncode``) on the socket.

What it preloads, and why no more: torch, torch.distributed, torch._dynamo (which torch's
optimizers import) and distrun's worker modules. Their
import runs no user code and starts no thread (checked: a fork is refused while this process has
more than one thread, e.g. numpy's BLAS pool when ``OMP_NUM_THREADS`` is unset). The user's
module is not preloaded: code at its top level may read the worker's own variables (``RANK``,
``TORCHELASTIC_RESTART_COUNT``), seed or draw random numbers, open files or start threads, and
preloaded it would run once for every restart of every rank, with another rank's values. It is
imported by each worker as a cold start imports it.

What a forked worker shares with its zygote and a cold one does not: Python's hash seed (the
same for every worker of one zygote; ``PYTHONHASHSEED`` unset gives each cold worker its own).
Python's ``random`` and numpy's global generator are reseeded from the OS in the child, as a
fresh process seeds them. ``DISTRUN_LAUNCHER_PID`` names the zygote, the child's parent: the
child dies with it (:mod:`distrun._launch.lifeline`), and the zygote dies with the launcher.

Messages (JSON, one per ``SOCK_SEQPACKET`` packet), launcher to zygote: ``{"fork": {"args",
"env", "cwd"}}`` with the child's fds 0, 1, 2 attached; zygote to launcher: ``{"ready": pid}``
or ``{"unsafe": why}`` once, ``{"forked": pid}`` or ``{"refused": why}`` per request,
``{"exit": pid, "code": returncode}`` per child. The launcher closing its end ends the zygote.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import sys
from typing import Any, NoReturn

from distrun._launch.lifeline import LAUNCHER_PID_ENV, die_with

__all__ = ["main", "os_threads"]

#: imported before the first fork: what every worker imports before its first step (torch's
#: optimizers import torch._dynamo, and with it sympy and most of torch.distributed, when the
#: first one is made: two thirds of a warm worker's start when it was left to the worker)
PRELOAD = ("torch", "torch.distributed", "torch.nn", "torch.optim", "torch._dynamo",
           "distrun._launch.lifeline", "distrun._worker.store", "distrun._train.trainer",
           "distrun._train.task", "distrun._train.builtin", "distrun._train.loop", "distrun.plugin",
           "distrun._strategies.process_group", "distrun._strategies.single")
WORKER_MODULE = "distrun._worker.main"
#: the largest request (the environment, mostly)
MAX_MESSAGE = 1 << 20


def os_threads() -> int:
    """This process's threads, as the kernel counts them (C++ pools included)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # not Linux: Python's own count is all there is
        import threading

        return threading.active_count()


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    try:
        sock.send(json.dumps(message).encode())
    except OSError:  # the launcher is gone: its end closing ends this loop
        pass


def _preload() -> str | None:
    """Import what every worker imports; why forking is unsafe afterwards, or None."""
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - a cold start reports it in the worker
            return f"importing {name} failed: {type(exc).__name__}: {exc}"
        threads = os_threads()
        if threads != 1:  # said at once: importing the rest would only cost the workers
            return f"{threads} threads after importing {name}: a fork would not copy them"
    if _cuda_driver_loaded():
        return "the CUDA driver was initialized while importing: a forked child cannot use it"
    return None


def _cuda_driver_loaded() -> bool:
    """True once this process has loaded the CUDA driver (``cuInit``; a fork cannot inherit it).

    Importing torch loads the CUDA runtime library but not the driver, which loads at the
    first CUDA call; torch's own flag says whether torch made one.
    """
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return True
    try:
        with open("/proc/self/maps") as fh:
            return "/libcuda.so" in fh.read()
    except OSError:
        return False


def _become_worker(sock: socket.socket, owned: list[int], stdio: list[int],
                   request: dict[str, Any]) -> NoReturn:
    """In the forked child: take the request's process state and run the worker entry point."""
    code = 1
    try:
        os.setsid()  # a session (and process group) of its own, as the launcher's Popen gives
        for target, fd in enumerate(stdio):
            os.dup2(fd, target)
        for fd in {*stdio, *owned} - {0, 1, 2}:
            try:
                os.close(fd)
            except OSError:
                pass
        sock.detach()
        env = dict(request["env"])
        env[LAUNCHER_PID_ENV] = str(os.getppid())  # die with the zygote, which dies with it
        os.environ.clear()
        os.environ.update(env)
        os.chdir(request["cwd"])
        numpy = sys.modules.get("numpy")
        if numpy is not None:  # a fresh process seeds numpy's global generator from the OS
            numpy.random.seed()
        args: list[str] = request["args"]
        split = args.index(WORKER_MODULE)
        sys.orig_argv = list(args)
        sys.argv = ["-m", *args[split + 1:]]  # run_module puts the module's file first
        sys.path[0] = os.getcwd()  # what `python -m` puts first
        import runpy

        sys.modules.pop(WORKER_MODULE, None)  # run fresh as __main__, as `python -m` does
        runpy.run_module(WORKER_MODULE, run_name="__main__", alter_sys=True)
        code = 0  # the worker ends the process itself (distrun._worker.main.finish)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - said on the worker's stderr, as a crash would be
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _serve(sock: socket.socket) -> None:
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ, None)
    children: dict[int, int] = {}  # pidfd -> pid
    while True:
        for key, _ in selector.select():
            if key.data is not None:  # a child's pidfd: it has exited
                pid = key.data
                selector.unregister(key.fd)
                os.close(key.fd)
                del children[key.fd]
                _, status = os.waitpid(pid, 0)
                _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})
                continue
            try:
                data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 3)
            except OSError:
                data, fds = b"", []
            if not data:
                return  # the launcher closed its end (or died)
            request = json.loads(data)["fork"]
            threads = os_threads()
            if threads != 1 or len(fds) != 3 or WORKER_MODULE not in request["args"]:
                for fd in fds:
                    os.close(fd)
                why = f"{threads} threads" if threads != 1 else "not a distrun worker command"
                _send(sock, {"refused": why})
                continue
            owned = [sock.fileno(), selector.fileno() if hasattr(selector, "fileno") else -1,
                     *children]
            pid = os.fork()
            if pid == 0:
                _become_worker(sock, [fd for fd in owned if fd >= 0], fds, request)
            for fd in fds:
                os.close(fd)
            pidfd = os.pidfd_open(pid)
            children[pidfd] = pid
            selector.register(pidfd, selectors.EVENT_READ, pid)
            _send(sock, {"forked": pid})


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1 or not argv[0].isdigit():
        print("usage: python -m distrun._worker.zygote FD (started by a launcher)",
              file=sys.stderr)
        raise SystemExit(2)
    launcher = int(os.environ.get(LAUNCHER_PID_ENV, "0") or 0)
    if launcher:
        die_with(launcher)
    sock = socket.socket(fileno=int(argv[0]))
    unsafe = _preload()
    if unsafe is not None:
        _send(sock, {"unsafe": unsafe})
        return
    _send(sock, {"ready": os.getpid()})
    _serve(sock)


if __name__ == "__main__":
    main()
