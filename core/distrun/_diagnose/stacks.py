"""Every thread's Python stack of a rank, on request, even when the rank is stuck in C.

The rank arms :mod:`faulthandler` on :data:`DUMP_SIGNAL` at start, writing to
``rank<N>.stacks`` beside its position record. faulthandler dumps from the signal handler
itself, in C, without the GIL: a rank blocked in a gloo wait, a read, a C loop that holds the
GIL, still answers. Its launcher (or ``distrun stacks``) sends the signal and reads what was
appended. A real-time signal, so no library's handler is replaced; sent only to a rank whose
record says it is armed (its default action would end a process that is not).

Torch-free: the launcher imports it.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import re
import signal
import sysconfig
import time
from dataclasses import dataclass, field
from typing import IO, Any

__all__ = ["DUMP_SIGNAL", "Frame", "Stacks", "arm", "dump_stacks", "parse_stacks"]

#: the signal a rank dumps its stacks on
DUMP_SIGNAL = signal.SIGRTMIN + 6 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR2

_armed_file: IO[str] | None = None  # kept open for faulthandler (it writes to the fd)


def arm(folder: str, rank: int, rec: Any) -> bool:
    """In the rank: dump every thread's stack to ``folder/rank<N>.stacks`` on
    :data:`DUMP_SIGNAL`; mark the record armed. False where faulthandler cannot."""
    global _armed_file
    import faulthandler

    try:
        fh = open(os.path.join(folder, f"rank{rank}.stacks"), "a")  # noqa: SIM115
        faulthandler.register(DUMP_SIGNAL, file=fh, all_threads=True, chain=False)
    except (OSError, RuntimeError, ValueError):
        return False
    _armed_file = fh
    from distrun._diagnose.position import ARMED

    rec.set_flag(ARMED)
    return True


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str

    def source(self) -> str:
        """The line's code, without a trailing comment."""
        text = linecache.getline(self.file, self.line).strip()
        code, sep, _ = text.partition("  #")
        return code.rstrip() if sep and code.count('"') % 2 == 0 and \
            code.count("'") % 2 == 0 else text

    def where(self) -> str:
        text = self.source()
        return f"{os.path.basename(self.file)}:{self.line}" + (f" ({text})" if text else "")


@dataclass
class Stacks:
    """One rank's dump: each thread's frames, innermost first; ``main``: the index of the
    thread that runs the target (the one whose outermost frame is a module's)."""

    text: str
    threads: list[list[Frame]] = field(default_factory=list)
    main: int = -1

    def in_user_code(self) -> bool:
        """Whether the main thread's innermost Python frame is the user's (it runs, or
        sleeps or reads in, their own code), not inside a library."""
        if self.main < 0 or not self.threads[self.main]:
            return False
        return not _library(self.threads[self.main][0].file)

    def user_frame(self) -> Frame | None:
        """The innermost frame of the main thread that is the user's code: not the standard
        library, an installed package, or distrun's own (None: no such frame, as in a
        backward pass, which runs in torch)."""
        if self.main < 0:
            return None
        frames = self.threads[self.main]
        return next((f for f in frames if not _library(f.file)), None)


_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def parse_stacks(text: str) -> Stacks:
    """faulthandler's dump, as :class:`Stacks`."""
    out = Stacks(text)
    for line in text.splitlines():
        if _THREAD.match(line):
            out.threads.append([])
            continue
        m = _FRAME.match(line)
        if m and out.threads:
            out.threads[-1].append(Frame(m.group(1), int(m.group(2)), m.group(3)))
    for i, frames in enumerate(out.threads):
        if frames and frames[-1].function == "<module>":
            out.main = i
            break
    else:
        if out.threads:
            out.main = len(out.threads) - 1  # faulthandler lists the main thread last
    return out


def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths.get(k, "") for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # distrun's own
    return tuple(sorted(r + os.sep for r in roots if r))


_ROOTS: tuple[str, ...] | None = None


def _library(path: str) -> bool:
    global _ROOTS
    if _ROOTS is None:
        _ROOTS = _library_roots()
    if path.startswith("<") or "/site-packages/" in path or "/dist-packages/" in path:
        return True
    if path.startswith(_ROOTS):
        return True
    # distrun's plugins, installed from a checkout (editable): distrun_<name>/ packages
    return any(part.startswith("distrun_") for part in path.split(os.sep)[:-1])


def dump_stacks(targets: dict[int, tuple[int, str]], wait: float = 3.0) -> dict[int, Stacks]:
    """Ask each rank ``rank -> (pid, stacks file)`` for its stacks; what each appended.

    A rank that does not answer within ``wait`` seconds (stopped meanwhile, or gone) is
    left out."""
    sizes: dict[int, int] = {}
    for rank, (pid, path) in targets.items():
        try:
            sizes[rank] = os.path.getsize(path)
        except OSError:
            sizes[rank] = 0
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, DUMP_SIGNAL)
    out: dict[int, Stacks] = {}
    deadline = time.monotonic() + wait
    last: dict[int, tuple[int, float]] = {}
    while len(out) < len(targets) and time.monotonic() < deadline:
        time.sleep(0.05)
        now = time.monotonic()
        for rank, (_, path) in targets.items():
            if rank in out:
                continue
            try:
                size = os.path.getsize(path)
            except OSError:
                continue
            if size <= sizes[rank]:
                continue
            seen = last.get(rank)
            if seen is None or seen[0] != size:
                last[rank] = (size, now)  # still writing: read once it is quiet for 0.15 s
            elif now - seen[1] >= 0.15:
                with open(path, "rb") as fh:
                    fh.seek(sizes[rank])
                    out[rank] = parse_stacks(fh.read().decode(errors="replace"))
    return out
