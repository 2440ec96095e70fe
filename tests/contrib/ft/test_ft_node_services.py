"""A plugin's node service under --ft: each replica group's start and end reach it, in the
launcher's one process (the worker group every launcher runs its ranks in tells it)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from distrun.testing import run_cli

CORE_TESTS = Path(__file__).resolve().parents[2] / "core"  # node_service_plugin.py


def test_a_node_service_hears_each_replica_groups_start_and_end(ft, tmp_path):
    env = ft.env(tmp_path, NODE_SERVICE_LOG=str(tmp_path / "service.jsonl"))
    env["PYTHONPATH"] = os.pathsep.join([str(CORE_TESTS), env["PYTHONPATH"]])
    env["DISTRUN_PLUGINS"] += ",node_service_plugin"
    r = run_cli("run", "--ft", "--replica-groups", "2", "--nproc-per-node", "1",
                "--strategy", "ddp", "--batch-size", "16", "--max-epochs", "99",
                "--max-steps", "4", "--timeout", "60", "--ft-heartbeat", "1", "--seed", "3",
                "ft_task:Task", cwd=tmp_path, env=env, timeout=240)
    assert r.returncode == 0, r
    events = [json.loads(line) for line in (tmp_path / "service.jsonl").read_text().splitlines()]
    assert len({e["launcher"] for e in events}) == 1, events  # one service, the launcher's
    started = [e for e in events if e["event"] == "started"]
    ended = [e for e in events if e["event"] == "ended"]
    # one rank per group, each group rank 0 of its own world of 1
    assert [(e["ranks"], e["world"]) for e in started] == [([0], 1), ([0], 1)], events
    assert len({pid for e in started for pid in e["pids"]}) == 2, events
    assert [e["codes"] for e in ended] == [[0], [0]], events
