"""The session's reference run: the uninterrupted training every recovery test compares with."""

from __future__ import annotations

from pathlib import Path

import pytest
from distrun.testing import run_cli
from elastic_helpers import TASK, TRAIN, plugin_env


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run (core launcher, no elastic): its record folder."""
    cwd = tmp_path_factory.mktemp("reference")
    rec = cwd / "rec"
    result = run_cli("run", *TRAIN, "--name", "ref", TASK, cwd=cwd, env=plugin_env(rec))
    assert result.returncode == 0, result
    return rec
