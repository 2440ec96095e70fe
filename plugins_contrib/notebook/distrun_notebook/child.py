"""The forked side: leave the kernel's machinery, take torchrun's environment, run, report.

A forked child starts as a copy of the kernel: its ``sys.stdout`` is the kernel's ZMQ stream,
``get_ipython()`` answers with the kernel's shell, an asyncio loop counts as running and the
signal wake-up fd is the kernel's. None of that may be used from the copy (ZMQ sockets are not
fork-safe, and a signal written to the shared wake-up fd would reach the kernel's loop), so the
child puts plain equivalents in their place before the user's code runs. It always ends with
``os._exit``: the kernel's atexit handlers and buffers belong to the kernel.
"""

from __future__ import annotations

import builtins
import logging
import os
import pickle
import signal
import struct
import sys
import traceback
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NoReturn

__all__ = ["HEADER", "in_launched_process", "run_child"]

#: a report is one pickled tuple behind its length: ("ok", payload | None),
#: ("error", summary, traceback text) or ("exit", code)
HEADER = struct.Struct("!Q")
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_launched = False


def in_launched_process() -> bool:
    """True inside a process that notebook_launcher started (it may not launch again)."""
    return _launched


def run_child(rank: int, env: Mapping[str, str], out_fd: int, err_fd: int, report_fd: int,
              close_fds: Iterable[int], target: Callable[[], Any],
              interrupted: Callable[[], bool] = lambda: False) -> NoReturn:
    """Everything a forked rank does; never returns to the kernel's code.

    ``interrupted()`` says whether a SIGINT reached this process before it had its own
    handler (the launcher's handler, inherited, only counted it).
    """
    global _launched
    _launched = True
    code = 1
    try:
        try:
            os.setpgid(0, 0)  # its own group: the kernel's interrupt is the launcher's to forward
        except OSError:
            pass
        for fd in close_fds:
            try:
                os.close(fd)
            except OSError:
                pass
        _redirect_stdio(out_fd, err_fd)
        _leave_the_kernel()
        if interrupted():
            raise KeyboardInterrupt
        os.environ.update(env)
        from distrun.plugin import join_launcher

        # SIGKILL when the kernel dies, as distrun's own workers; rank 0: its store on the
        # launcher's loopback socket
        join_launcher()
        _limit_threads()
        code = _run(rank, target, report_fd)
    except BaseException as exc:  # the setup failed: still say why
        try:
            _send(report_fd, ("error", _summary(exc), _format(exc)))
        except BaseException:
            pass
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        os._exit(code)


def _run(rank: int, target: Callable[[], Any], report_fd: int) -> int:
    try:
        value = target()
    except SystemExit as exc:
        code = _exit_code(exc.code)
        _send(report_fd, ("ok", None) if code == 0 else ("exit", code))
        return code
    except BaseException as exc:
        _send(report_fd, ("error", _summary(exc), _format(exc)))
        return 1
    payload = None
    if rank == 0:  # only rank 0's value goes back; the others' need not pickle
        try:
            payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            summary = f"its return value ({type(value).__name__}) cannot be pickled: {exc}"
            _send(report_fd, ("error", summary, _format(exc)))
            return 1
    _send(report_fd, ("ok", payload))
    return 0


def _send(fd: int, message: tuple[Any, ...]) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(HEADER.pack(len(data)) + data)
    while view:  # blocking writes: the launcher reads while it waits
        view = view[os.write(fd, view):]


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("message"), as the interpreter would
    return 1


def _summary(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__


def _format(exc: BaseException) -> str:
    """The traceback without this package's own frames at the top."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb)).rstrip()


def _redirect_stdio(out_fd: int, err_fd: int) -> None:
    """fds 1 and 2 become the launcher's pipes (C and subprocess output too), stdin /dev/null."""
    old_out = {id(s) for s in (sys.stdout, sys.__stdout__) if s is not None}
    old_err = {id(s) for s in (sys.stderr, sys.__stderr__) if s is not None}
    null = os.open(os.devnull, os.O_RDONLY)
    for src, dst in ((null, 0), (out_fd, 1), (err_fd, 2)):
        if src != dst:
            os.dup2(src, dst)
            os.close(src)
    opts: dict[str, Any] = dict(encoding="utf-8", errors="backslashreplace", buffering=1,
                                closefd=False)
    out, err = open(1, "w", **opts), open(2, "w", **opts)  # noqa: SIM115
    stdin = open(0, closefd=False)  # noqa: SIM115
    for name, stream in (("stdout", out), ("stderr", err), ("stdin", stdin)):
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    # Handlers set up in the kernel (logging.basicConfig in a cell, an earlier in-kernel fit)
    # hold the kernel's streams: point them at ours.
    loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                      if isinstance(v, logging.Logger))]
    for logger in loggers:
        for handler in logger.handlers:
            if type(handler) is logging.StreamHandler:
                stream = getattr(handler, "stream", None)
                if id(stream) in old_out:
                    handler.setStream(out)
                elif id(stream) in old_err:
                    handler.setStream(err)


def _no_input(prompt: object = "") -> str:
    raise EOFError("a process started by notebook_launcher has no standard input")


def _leave_the_kernel() -> None:
    sys.displayhook = sys.__displayhook__
    sys.excepthook = sys.__excepthook__
    builtins.input = _no_input  # the kernel's input() asks the front end over ZMQ
    if "IPython" in sys.modules:
        # No shell in the copy: IPython's display() then prints, and rich, tqdm and friends
        # write plain text instead of sending widgets over the kernel's sockets.
        try:
            from IPython.core.interactiveshell import InteractiveShell

            if InteractiveShell.initialized():
                type(InteractiveShell.instance()).clear_instance()
        except Exception:
            pass
        builtins.__dict__.pop("get_ipython", None)
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:
        pass
    if "asyncio" in sys.modules:
        import asyncio

        asyncio._set_running_loop(None)  # the kernel's loop does not run here
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for name in ("SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGALRM"):
        sig = getattr(signal, name, None)
        if sig is not None and callable(signal.getsignal(sig)):
            signal.signal(sig, signal.SIG_DFL)


def _limit_threads() -> None:
    """OMP_NUM_THREADS only acts when OpenMP starts: a torch the kernel loaded is told here."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    try:
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    except ValueError:
        pass
