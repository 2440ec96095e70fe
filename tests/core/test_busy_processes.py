"""Whether a rank works, as the stall watcher asks it (:mod:`distrun._diagnose.processes`), on
a machine whose every core is taken: the CI run that called a working rank stalled."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

from distrun._diagnose.processes import busy_sessions

#: one core of this machine: the test's processes share it and leave the others alone
CORE = min(os.sched_getaffinity(0))
#: says it started (one line), then spins at the lowest priority, or waits for a line nobody
#: writes
SPIN = "import os; os.nice(19); print(flush=True)\nwhile True: pass"
WAIT = "import sys; print(flush=True); sys.stdin.readline()"


def _on_the_core() -> None:
    os.sched_setaffinity(0, {CORE})


def _started(code: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            preexec_fn=_on_the_core)
    assert proc.stdout is not None and proc.stdout.readline() == b"\n"
    return proc


def test_a_process_that_computes_works_though_its_core_is_taken_and_one_that_waits_does_not():
    """Busy loops on one core, and on it a process that spins at the lowest priority (it gets
    a sliver of the core, under what counts as work in CPU time): it is still said to work
    (it waits for the core all the time it does not have it); one that waits in a read is
    not."""
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                             start_new_session=True, preexec_fn=_on_the_core) for _ in range(2)]
    procs = []
    try:
        procs = [_started(SPIN), _started(WAIT)]
        spins, waits = procs
        # (each session is a scheduling group of its own: its priority is the group's)
        with contextlib.suppress(OSError), open(f"/proc/{spins.pid}/autogroup", "w") as fh:
            fh.write("19")
        assert busy_sessions({spins.pid, waits.pid}) == {spins.pid}
    finally:
        for proc in (*load, *procs):
            proc.kill()
            proc.wait()
