"""metrics.csv across a restart: the rows of the steps a checkpoint holds are in the file,
whenever a rank dies after that checkpoint committed (a resumed run does not train them again).
"""

from __future__ import annotations

import pytest
from elastic_helpers import TASK, TRAIN, plugin_env, records

from distrun._loggers.csv_file import read_metrics
from distrun.testing import run_cli


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_rank_killed_right_after_a_commit_loses_no_metrics_row(tmp_path):
    """Rank 1 SIGKILLs itself once step 20's checkpoint is committed, before the step's
    boundary (where its row, and those of the steps since the last vote, were still only
    packed): the run resumes at step 20 and metrics.csv has every step once. Rank 0 takes a
    second over step 20's row, the last of those it logs after the commit, so the launcher's
    SIGTERM comes while it logs them (under load it once came there by itself, and cut the
    rows not yet logged)."""
    rec = tmp_path / "rec"
    result = run_cli("run", "--max-restarts", "1", "--ckpt-every-n-steps", "10", *TRAIN,
                     "--log-every-n-steps", "1", "--name", "m", TASK, cwd=tmp_path,
                     env=plugin_env(rec, EL_KILL_AFTER_COMMIT="0:20:1", EL_SLOW_ROW="0:20:0"),
                     timeout=540)
    assert result.returncode == 0, result
    assert "rank 1 exited with code 137; restarting the workers from the latest" in result.stderr, \
        result
    starts = [e["step"] for e in records(rec, "events.jsonl") if e["rank"] == 0]
    assert starts == [0, 20], result  # resumed from the checkpoint the kill followed
    steps = [int(r["step"]) for r in read_metrics(str(tmp_path / "runs" / "m" / "metrics.csv"))
             if "loss" in r]
    assert steps == list(range(1, 37)), result
