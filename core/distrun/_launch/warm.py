"""Warm starts: a launcher's spare per local rank that forks its workers (torch-free).

:class:`WarmPool` starts one zygote (:mod:`distrun._worker.zygote`) per local rank, from the
launcher's main thread, with the environment and working directory the workers inherit. Once it
has imported torch, :meth:`WarmPool.spawn` turns a worker command line into a forked worker in
a few milliseconds instead of a new interpreter that imports torch again, and returns a
:class:`WarmProcess`, which a launcher uses as it would the ``subprocess.Popen`` of a cold start
(``pid``, ``poll``, ``wait``, ``send_signal``, ``returncode``). Where a zygote cannot serve
(gone, refused, still importing, not a ``python -m distrun._worker.main`` command),
:meth:`~WarmPool.spawn` returns None and the launcher starts the worker cold.

The forked worker is a session leader, like a cold one (``os.killpg(proc.pid, sig)`` reaches
it and what it starts); its parent is its zygote, which reports its exit status. The zygote dies
with the launcher (``PR_SET_PDEATHSIG``) and the worker with the zygote, so a launcher's death
still takes every worker with it; a zygote killed while its worker runs takes the worker too,
which the launcher sees as a failed worker (exit -9), and its next start of that rank is cold.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from distrun._launch.lifeline import LAUNCHER_PID_ENV, die_with_parent

__all__ = ["WarmPool", "WarmProcess", "warm_command"]

ZYGOTE_MODULE = "distrun._worker.zygote"
WORKER_MODULE = "distrun._worker.main"
#: seconds a start waits for a zygote that is still importing torch before starting cold
READY_TIMEOUT = 120.0


def warm_command(command: Sequence[str]) -> list[str] | None:
    """The zygote's command line for a worker ``command`` (same interpreter and flags), or None
    when ``command`` is not ``PYTHON [FLAGS] -m distrun._worker.main ...``."""
    args = list(command)
    for i in range(1, len(args) - 1):
        if args[i] == "-m" and args[i + 1] == WORKER_MODULE:
            if any(not a.startswith("-") for a in args[1:i]):
                return None  # an interpreter option with a value: not ours to copy
            return [*args[:i], "-m", ZYGOTE_MODULE]
        if not args[i].startswith("-"):
            return None
    return None


class _Zygote:
    """One zygote process and the launcher's end of its socket."""

    def __init__(self, command: list[str], env: Mapping[str, str], cwd: str) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - its errors (--debug); close()
        self.lock = threading.RLock()
        self.state = "starting"  # -> ready | unsafe | gone
        self.why = ""
        self.ended = False  # its end of the socket closed: nothing more to read
        self.codes: dict[int, int] = {}
        self.pending: list[dict[str, Any]] = []
        try:
            self.proc = subprocess.Popen(
                [*command, str(theirs.fileno())], env={**env, LAUNCHER_PID_ENV: str(os.getpid())},
                cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.log,
                pass_fds=(theirs.fileno(),), start_new_session=True,
                preexec_fn=die_with_parent())
        finally:
            theirs.close()

    def _take(self, message: dict[str, Any]) -> None:
        if "exit" in message:
            self.codes[message["exit"]] = message["code"]
        elif "ready" in message:
            self.state = "ready"
        elif "unsafe" in message:
            self.state, self.why = "unsafe", message["unsafe"]
        else:
            self.pending.append(message)

    def read(self, timeout: float | None) -> bool:
        """Take the messages that arrive within ``timeout`` (None: wait for one); False at EOF."""
        with self.lock:
            if self.ended:
                return False
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                ready, _, _ = select.select([self.sock], [], [], left)
                if not ready:
                    return True
                try:
                    data = self.sock.recv(1 << 16)
                except OSError:
                    data = b""
                if not data:
                    self._gone("it exited")
                    return False
                self._take(json.loads(data))
                timeout = deadline = 0.0  # drain what is already there, then return

    def _gone(self, why: str) -> None:
        self.ended = True
        if self.state != "unsafe":  # an unsafe one stays so: renew() would not help
            self.state = "gone"
        self.why = self.why or why
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.state == "starting" and time.monotonic() < deadline:
            if not self.read(deadline - time.monotonic()):
                break
        return self.state == "ready"

    def fork(self, args: Sequence[str], env: Mapping[str, str], cwd: str,
             stdio: Sequence[int]) -> int | None:
        with self.lock:
            if not self.wait_ready(READY_TIMEOUT):
                return None
            try:
                socket.send_fds(self.sock, [json.dumps(
                    {"fork": {"args": list(args), "env": dict(env), "cwd": cwd}}).encode()],
                    list(stdio))
            except OSError as exc:
                self._gone(f"cannot reach it: {exc}")
                return None
            while not self.pending:
                if not self.read(None):
                    return None
            answer = self.pending.pop(0)
            if "refused" in answer:
                self.why = answer["refused"]
                return None
            return int(answer["forked"])

    def close(self) -> None:
        with self.lock:
            self.sock.close()
            if self.state != "gone":
                try:
                    self.proc.wait(timeout=5.0)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
                self.state = "gone"
            self.log.close()

    def errors(self) -> str:
        try:
            self.log.seek(0)
            return self.log.read().decode(errors="replace").strip()
        except (OSError, ValueError):
            return ""


class WarmProcess:
    """A worker forked by a zygote, with the part of ``subprocess.Popen`` launchers use."""

    def __init__(self, pid: int, zygote: _Zygote, args: Sequence[str]) -> None:
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None
        self._zygote = zygote
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except OSError:  # it has already ended (the zygote says how) or no pidfds here
            self._pidfd = None

    def _exited(self, timeout: float) -> bool:
        if self._pidfd is None:
            time.sleep(min(timeout, 0.01))
            return True
        return bool(select.select([self._pidfd], [], [], timeout)[0])

    def poll(self) -> int | None:
        """The exit code (``-N``: ended by signal N), or None while it runs."""
        if self.returncode is not None:
            return self.returncode
        zygote = self._zygote
        with zygote.lock:  # the agent's heartbeat thread may stop the workers meanwhile
            if self.returncode is not None:
                return self.returncode
            alive = zygote.read(0.0)
            if self.pid not in zygote.codes and alive and self._exited(0.0):
                # it has ended: its zygote's report follows within moments
                deadline = time.monotonic() + 5.0
                while self.pid not in zygote.codes and alive and time.monotonic() < deadline:
                    alive = zygote.read(0.05)
            if self.pid in zygote.codes:
                self.returncode = zygote.codes.pop(self.pid)
            elif not alive and self._exited(0.0 if self._pidfd is None else 5.0):
                # its zygote is gone, and with it (PR_SET_PDEATHSIG) the worker: SIGKILL
                self.returncode = -9
            if self.returncode is not None and self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._exited(min(left, 1.0))
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(15)

    def kill(self) -> None:
        self.send_signal(9)


class WarmPool:
    """One zygote per local rank; :meth:`spawn` forks a worker from it (None: start it cold).

    Start it from the launcher's main thread (the zygotes die with the thread that started
    them), with ``command`` one worker's command line and ``env`` the environment every worker
    inherits; :meth:`close` ends them (also when the launcher fails).
    """

    def __init__(self, command: Sequence[str], local_ranks: int,
                 env: Mapping[str, str] | None = None, cwd: str | None = None,
                 debug: bool = False) -> None:
        zygote = warm_command(command)
        if zygote is None:
            raise ValueError(f"not a distrun worker command: {' '.join(command)[:120]}")
        self.command = zygote
        self.env = dict(os.environ if env is None else env)
        self.cwd = cwd or os.getcwd()
        self.debug = debug
        self._said: set[int] = set()
        self.zygotes: dict[int, _Zygote] = {
            lr: _Zygote(self.command, self.env, self.cwd) for lr in range(local_ranks)}

    @staticmethod
    def serves(command: Sequence[str]) -> bool:
        """Whether a spare can fork ``command``: ``PYTHON [FLAGS] -m distrun._worker.main ...``
        (distrun's worker, which every ``distrun run`` starts; not another program)."""
        return warm_command(command) is not None

    def spawn(self, local_rank: int, args: Sequence[str], env: Mapping[str, str],
              stdio: Sequence[int] = (0, 1, 2), cwd: str | None = None) -> WarmProcess | None:
        """Fork worker ``args`` with exactly ``env``, ``cwd`` and fds 0-2 ``stdio``; None when
        this rank's zygote cannot (the caller starts it cold)."""
        zygote = self.zygotes.get(local_rank)
        if zygote is None or warm_command(args) != self.command:
            return None
        pid = zygote.fork(args, env, cwd or self.cwd, stdio)
        if pid is None:
            self._say(local_rank, zygote)
            return None
        return WarmProcess(pid, zygote, args)

    def _say(self, local_rank: int, zygote: _Zygote) -> None:
        if not self.debug or local_rank in self._said:
            return
        self._said.add(local_rank)
        detail = zygote.errors()
        sys.stderr.write(
            f"distrun: local rank {local_rank} starts cold: its warm spare is {zygote.state} "
            f"({zygote.why or 'no reason given'}){': ' + detail[-400:] if detail else ''}\n"
        )

    def state(self, local_rank: int) -> str:
        """``starting``, ``ready``, ``unsafe`` or ``gone``."""
        zygote = self.zygotes[local_rank]
        zygote.read(0.0)
        return zygote.state

    def renew(self) -> None:
        """Start a new zygote for each one that is gone (it imports torch in the background)."""
        for lr, zygote in list(self.zygotes.items()):
            zygote.read(0.0)
            if zygote.state == "gone":
                zygote.close()
                self.zygotes[lr] = _Zygote(self.command, self.env, self.cwd)
                self._said.discard(lr)

    def pids(self) -> dict[int, int]:
        """Each local rank's zygote process id."""
        return {lr: z.proc.pid for lr, z in self.zygotes.items()}

    def close(self) -> None:
        """End every zygote (closing its socket ends it; SIGKILL after 5 s)."""
        for zygote in self.zygotes.values():
            zygote.close()
