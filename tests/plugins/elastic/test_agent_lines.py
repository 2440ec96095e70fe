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
