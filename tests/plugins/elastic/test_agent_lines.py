"""The agent's one-line messages reach a stream shared with the workers whole.

Launchers run with PYTHONUNBUFFERED=1 (as distrun sets it for workers and CI sets it for
everything), where ``print`` writes a line and its newline in two calls: a worker's line written
between them joined the agent's ("... (restart 1 of 3)error: fenced: ..."), and the fencing
test's line match failed under load.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

WRITER = (
    "import sys\n"
    "from distrun_elastic.agent import _say\n"
    "for i in range(3000):\n"
    "    _say(f'{sys.argv[1]} line {i} ' + 'x' * 60)\n"
)


def test_agent_lines_stay_whole_when_two_processes_share_stderr():
    read, write = os.pipe()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, name], stderr=write, env=env)
             for name in "ab"]
    os.close(write)
    with os.fdopen(read, "rb") as stream:
        data = stream.read().decode()
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    lines = data.split("\n")[:-1]
    broken = [ln for ln in lines if not re.fullmatch(r"distrun: [ab] line \d+ x{60}", ln)]
    assert len(lines) == 6000 and not broken, broken[:3]


def test_the_failure_named_is_the_cause_not_a_peer_it_took_down():
    """The agent picks the cause from its own poll, before anything is stopped (its workers are
    a distrun worker group: torch never stops them first). CI once saw torch's SIGTERM named
    ("exited with code 143; restarting") when torch stopped the siblings first, so a usage
    error was retried: that path is gone with torch's process context."""
    from distrun_elastic.agent import root_cause

    ranks = {0: 0, 1: 1}
    never = lambda lr: False  # noqa: E731
    # a rank killed by a signal is the cause (an OOM kill)
    assert root_cause([(0, -9), (1, 1)], ranks, never) == (0, -9)
    assert root_cause([(0, -15), (1, 2)], ranks, never) == (0, -15)
    # not a rank that lost its peer
    assert root_cause([(0, 1), (1, 1)], ranks, lambda lr: lr == 0) == (1, 1)
    # otherwise the lowest rank
    assert root_cause([(1, 3), (0, 3)], ranks, never) == (0, 3)


def test_the_rendezvous_events_keep_their_names_read_from_the_frame():
    # launch._name_events_from_frames replaces torch's inspect.stack() lookup (0.04 s of a
    # restart's round) with the frame itself: the same name at every depth it is asked for.
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from distrun_elastic import launch

    torchs = dynamic_rendezvous.get_method_name
    launch._name_events_from_frames()
    ours = dynamic_rendezvous.get_method_name
    try:
        assert getattr(ours, "distrun_from_frame", False)

        class Handler:
            def next_rendezvous(self):
                return self._record()

            def _record(self):
                names = []
                for depth in (1, 2, 3, 10_000):  # (a loop: a comprehension is a frame)
                    names.append((torchs(depth), ours(depth)))
                return names

        names = Handler().next_rendezvous()
        assert [t for t, _ in names] == [o for _, o in names], names
        assert names[0][0] == "_record" and names[1][0] == "next_rendezvous", names
        assert names[-1][0] == "no_method_name", names
    finally:
        dynamic_rendezvous.get_method_name = torchs
