"""The session's reference run (the uninterrupted training every recovery test compares with);
this folder's helper modules become importable under pytest's importlib import mode."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
from elastic_helpers import TASK, TRAIN, plugin_env  # noqa: E402

from distrun.testing import run_cli  # noqa: E402


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run (core launcher, no elastic): its record folder."""
    cwd = tmp_path_factory.mktemp("reference")
    rec = cwd / "rec"
    result = run_cli("run", *TRAIN, "--name", "ref", TASK, cwd=cwd, env=plugin_env(rec))
    assert result.returncode == 0, result
    return rec
