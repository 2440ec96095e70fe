"""The launcher plugin that docs/writing-plugins.md shows, run as its reader would: the page's
own code installed as a module, a real `distrun run` through it, a rank that fails once."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from distrun.testing import run_cli

ROOT = Path(__file__).resolve().parents[2]

FAIL_ONCE = """\
import os, sys, time
attempt, rank = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]
print(f"rank {rank} attempt {attempt} world {os.environ['WORLD_SIZE']}", flush=True)
if rank == "0":
    open(f"printed-{attempt}", "w").close()
if attempt == "0" and rank == "1":
    # once rank 0 has printed: under load it may start much later, and the group stops it as
    # soon as rank 1 fails
    deadline = time.monotonic() + 60
    while not os.path.exists("printed-0") and time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit("rank 1 fails its first attempt")
"""


def _example() -> str:
    text = (ROOT / "docs" / "writing-plugins.md").read_text()
    section = text[text.index("\n## Launchers\n"):text.index("\n## Rules of the house\n")]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "the Launchers section shows one plugin"
    return blocks[0]


def test_the_launcher_example_is_under_60_lines():
    assert len(_example().splitlines()) < 60


@pytest.mark.slow
def test_the_launcher_example_relaunches_a_failed_node_and_the_run_ends_well(tmp_path):
    (tmp_path / "distrun_relaunch.py").write_text(_example())
    (tmp_path / "fail_once.py").write_text(FAIL_ONCE)
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
           "DISTRUN_PLUGINS": "distrun_relaunch"}
    result = run_cli("run", "--relaunch", "1", "--nproc-per-node", "2", "fail_once.py",
                     cwd=tmp_path, env=env)
    assert result.returncode == 0, result
    lines = result.stdout.splitlines()
    for rank in (0, 1):
        for attempt in (0, 1):
            assert f"rank {rank} attempt {attempt} world 2" in lines, result
    assert "distrun: rank 1 failed with exit code 1" in result.stderr, result
    assert "distrun-relaunch: exit 1; starting the ranks again (1 of 1)" in result.stderr, result
    # without the flag the plugin leaves the launch to the core's launcher: one attempt, exit 1
    plain = run_cli("run", "--nproc-per-node", "2", "fail_once.py", cwd=tmp_path, env=env)
    assert plain.returncode == 1, plain
    assert "starting the ranks again" not in plain.stderr, plain
