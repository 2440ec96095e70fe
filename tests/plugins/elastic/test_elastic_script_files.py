"""A plain script under the elastic agent: what its restart line says, and that the workers'
files (torch's error files; their output only with ``--log-dir``) are gone when the run ends
(success, failure, signal), unless ``--log-dir`` asked for them.

Each run gets its own ``TMPDIR`` (where the files go when nobody asked for them), so "nothing
left" is checked exactly.
"""

from __future__ import annotations

import getpass
import os
import signal
import sys
from pathlib import Path

import pytest
from elastic_helpers import HERE, Launcher

from distrun.testing import run_cli

ENV = {"DISTRUN_DISABLE_PLUGIN_AUTOLOAD": "1", "DISTRUN_PLUGINS": "distrun_elastic.plugin"}
SCRIPT_RESTART = ("distrun: rank 1 exited with code 3; restarting the workers: the script "
                  "starts over, and resumes from its own checkpoint if it saves one "
                  "(restart 1 of 1)")


def _tmpdir(tmp_path: Path) -> Path:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    return tmp


def _left(tmp: Path) -> list[str]:
    """What is in ``tmp`` but for torch's compile cache folder itself (importing
    torch._dynamo, which the warm spares preload, makes it: it is every run's of this user,
    not this run's output); anything in it still counts."""
    cache = tmp / f"torchinductor_{getpass.getuser()}"
    return sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p != cache)


@pytest.mark.slow
def test_a_restarted_script_is_told_it_starts_over_and_leaves_no_files(tmp_path):
    tmp = _tmpdir(tmp_path)
    result = run_cli("run", "--max-restarts", "1", "--nproc-per-node", "2",
                     str(HERE / "envdump.py"), cwd=tmp_path,
                     env={**ENV, "FAIL_FIRST": "1", "TMPDIR": str(tmp)})
    assert result.returncode == 0, result
    assert SCRIPT_RESTART in result.stderr.splitlines(), result
    assert "latest checkpoint" not in result.stderr, result
    assert result.stdout.count("ENV ") == 4, result  # both attempts' lines reached the terminal
    assert _left(tmp) == [], result


@pytest.mark.slow
def test_a_failed_script_run_leaves_no_files(tmp_path):
    tmp = _tmpdir(tmp_path)
    result = run_cli("run", "--max-restarts", "1", "--nproc-per-node", "2",
                     str(HERE / "envdump.py"), cwd=tmp_path,
                     env={**ENV, "FAIL_ALWAYS": "1", "TMPDIR": str(tmp)})
    assert result.returncode == 3, result
    assert "ValueError: injected failure" in result.stderr, result  # its last lines, reported
    assert _left(tmp) == [], result


@pytest.mark.slow
def test_a_script_run_stopped_by_sigterm_leaves_no_files(tmp_path):
    tmp = _tmpdir(tmp_path)
    (tmp_path / "hold.py").write_text(
        "import time\nprint('holding', flush=True)\ntime.sleep(120)\n")
    launcher = Launcher(["--max-restarts", "1", "--nproc-per-node", "2", "hold.py"],
                        {**ENV, "TMPDIR": str(tmp)}, tmp_path, "hold")
    try:
        launcher.wait_until(lambda: launcher.output().count("holding") == 2, "both ranks")
        assert any(p.name.startswith("distrun_elastic_") for p in tmp.iterdir())  # their folder
        os.kill(launcher.proc.pid, signal.SIGTERM)
        code = launcher.wait(timeout=120)
    finally:
        launcher.kill_all()
    assert code == 143, launcher.output()
    assert _left(tmp) == [], launcher.output()


@pytest.mark.slow
def test_log_dir_keeps_the_workers_files(tmp_path):
    tmp = _tmpdir(tmp_path)
    logs = tmp_path / "logs"
    result = run_cli("run", "--max-restarts", "1", "--nproc-per-node", "2", "--log-dir",
                     str(logs), str(HERE / "envdump.py"), cwd=tmp_path,
                     env={**ENV, "TMPDIR": str(tmp)})
    assert result.returncode == 0, result
    assert _left(tmp) == [], result
    kept = [p.name for p in logs.glob("rank*.log") if "ENV " in p.read_text()]
    assert sorted(kept) == ["rank0.log", "rank1.log"], sorted(map(str, logs.rglob("*")))


def test_only_a_task_is_restarted_from_distruns_checkpoint():
    from distrun_elastic.launch import trains_task

    worker = [sys.executable, "-u", "-m", "distrun._worker.main"]
    assert trains_task([*worker, "pkg.mod:Task", "--lr", "1"])
    assert not trains_task([*worker, "--script", "train.py"])
    assert not trains_task([*worker, "--module", "pkg.train"])
    assert not trains_task(["/usr/bin/env", "python", "train.py"])
