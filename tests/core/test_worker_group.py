"""The worker group every launcher runs its ranks in, seen from a plugin's node service.

A third-party plugin (``node_service_plugin.py``) offers a service through
``distrun_node_services``; whatever the launcher, it is told of each start of the node's
workers (their ranks and live pids) and of their end (their exit codes), in the launcher's
process. Real ``distrun run`` launches: the local launcher, and the elastic agent's restart.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from distrun.testing import run_cli

HERE = Path(__file__).resolve().parent
ENVDUMP = HERE.parent / "plugins" / "elastic" / "envdump.py"


def _env(tmp_path: Path, plugins: str) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
            "DISTRUN_DISABLE_PLUGIN_AUTOLOAD": "1", "DISTRUN_PLUGINS": plugins,
            "NODE_SERVICE_LOG": str(tmp_path / "service.jsonl")}


def _events(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "service.jsonl").read_text().splitlines()]


def test_a_node_service_sees_the_local_launchers_ranks_start_and_end(tmp_path):
    result = run_cli("run", "--nproc-per-node", "2", str(ENVDUMP), cwd=tmp_path,
                     env=_env(tmp_path, "node_service_plugin"))
    assert result.returncode == 0, result
    started, ended = _events(tmp_path)
    assert started["event"] == "started" and started["ranks"] == [0, 1], started
    assert started["world"] == 2 and len(set(started["pids"])) == 2, started
    # (whether each pid is still alive when the service hears of it depends on how soon a
    # short script ends: not asserted)
    assert ended == {"launcher": started["launcher"], "event": "ended", "ranks": [0, 1],
                     "codes": [0, 0]}, ended


@pytest.mark.slow
def test_a_node_service_sees_each_attempt_of_an_elastic_restart(tmp_path):
    result = run_cli("run", "--max-restarts", "1", "--nproc-per-node", "2", str(ENVDUMP),
                     cwd=tmp_path, env={**_env(tmp_path, "node_service_plugin,distrun_elastic.plugin"),
                                        "FAIL_FIRST": "1"})
    assert result.returncode == 0, result
    events = _events(tmp_path)
    assert [e["event"] for e in events] == ["started", "ended", "started", "ended"], events
    first, failed, second, done = events
    assert failed["codes"][1] == 3, failed  # rank 1 failed on purpose; rank 0 was stopped
    assert done["codes"] == [0, 0], done
    assert set(first["pids"]).isdisjoint(second["pids"]), events  # new processes
    assert first["launcher"] == second["launcher"], events  # one agent, told of both


def test_a_process_that_began_to_exit_shows_its_code_before_it_can_be_reaped():
    # what a launcher reads of a worker that has begun to exit (exiting_code): the kernel frees
    # a big process's memory before the exit can be reaped, and the code is there from the
    # start. Never reaped here before the reads, so each read is of the dying or dead process.
    import signal
    import subprocess
    import sys
    import time

    from distrun._launch.exits import exiting_code

    def child(code: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", code])

    killed = child("import time; b = bytearray(200 << 20); time.sleep(60)")
    exits_3 = child("import os; os._exit(3)")
    clean = child("pass")
    requeue = child("import os; os._exit(143)")
    running = child("import time; time.sleep(60)")
    try:
        time.sleep(0.5)
        killed.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 30
        while exiting_code(exits_3.pid) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        while exiting_code(killed.pid) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert exiting_code(killed.pid) == -9
        assert exiting_code(exits_3.pid) == 3
        time.sleep(0.5)  # the agreed exits are done by now: their codes are left to the reap
        assert exiting_code(clean.pid) is None
        assert exiting_code(requeue.pid) is None  # a saved stop the ranks agreed on
        assert exiting_code(running.pid) is None
        # and the reap agrees
        assert killed.wait() == -9 and exits_3.wait() == 3 and clean.wait() == 0
        assert requeue.wait() == 143
    finally:
        for p in (killed, exits_3, clean, requeue, running):
            p.kill()
            p.wait()
