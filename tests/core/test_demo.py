"""The README's demo: the digits CNN on core alone, default strategy, >= 95% accuracy."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from distrun.testing import run_cli

DEMO = Path(__file__).resolve().parents[2] / "examples" / "digits.py"


@pytest.mark.slow
def test_digits_demo_reaches_95_percent(tmp_path):
    result = run_cli("run", "--run-dir", str(tmp_path / "run"), str(DEMO), cwd=tmp_path,
                     timeout=900)
    assert result.returncode == 0, result
    assert "| fc1      | Linear  | 1.2 M" in result.stdout  # the classic MNIST CNN
    assert "| conv2    | Conv2d  | 18.5 K" in result.stdout
    acc = float(re.search(r"validation accuracy: ([0-9.]+)", result.stdout).group(1))
    assert acc >= 0.95, result.stdout
