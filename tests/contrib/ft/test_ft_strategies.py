"""The strategies a replica group runs under --ft: fsdp in a one-rank group trains and ends
(it hung: its in-memory process group left the group's store unserved for torchft's Manager),
and the digits demo's validation is there at the end of a fit stopped by --max-steps."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from distrun.testing import run_cli

DIGITS = str(Path(__file__).resolve().parents[3] / "examples" / "digits.py")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("distrun_fsdp") is None,
                    reason="needs the fsdp strategy: pip install distrun-fsdp")
def test_fsdp_in_a_one_rank_group_trains_and_validates(tmp_path):
    result = run_cli("run", "--ft", "--replica-groups", "1", "--strategy", "fsdp",
                     "--max-steps", "2", "--ft-heartbeat", "1", "--run-dir",
                     str(tmp_path / "run"), "--no-progress", DIGITS,
                     cwd=tmp_path, env={"OMP_NUM_THREADS": "1"}, timeout=150)
    assert result.returncode == 0, result
    assert re.search(r"validation accuracy: \d\.\d+", result.stdout), result
    csv = (tmp_path / "run" / "replica0" / "metrics.csv").read_text().splitlines()
    header = csv[0].split(",")
    last = dict(zip(header, csv[-1].split(",")))
    assert last["step"] == "2" and last.get("val_acc"), csv
