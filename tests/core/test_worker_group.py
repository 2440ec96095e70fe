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
