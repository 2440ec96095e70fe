"""Shared fixtures of the core tests: the tiny task file and a recorder-plugin environment."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
TINY = str(HERE / "tiny_task.py")


@pytest.fixture
def tiny_script() -> str:
    return TINY


@pytest.fixture
def recorder_env(tmp_path: Path) -> dict[str, str]:
    """Environment that loads tests/core/recorder_plugin.py and records into tmp_path/rec."""
    rec = tmp_path / "rec"
    rec.mkdir()
    return {
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "DISTRUN_PLUGINS": "recorder_plugin",
        "RECORD_DIR": str(rec),
    }
