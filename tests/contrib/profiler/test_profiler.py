"""distrun-profiler: real traces from a 2-rank DDP run; nothing on the step path when off."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

import pytest

import distrun
from distrun.testing import imports_torch, run_cli, run_on_ranks

TASK = Path(__file__).resolve().parents[2] / "core" / "tiny_task.py"


def traces(folder: Path) -> dict[int, Path]:
    """rank -> its trace file (HOST_rankN.MILLISECONDS.pt.trace.json)."""
    out = {}
    for path in folder.glob("*.pt.trace.json"):
        rank = int(path.name.split(".")[0].rsplit("_rank", 1)[1])
        assert rank not in out, f"two traces of rank {rank}"
        out[rank] = path
    return out


def event_names(path: Path) -> Counter:
    data = json.loads(path.read_text())
    assert isinstance(data["traceEvents"], list) and data["traceEvents"]
    return Counter(e.get("name") for e in data["traceEvents"])


def test_plugin_module_does_not_import_torch():
    assert not imports_torch("distrun_profiler.plugin")


def test_ddp_run_writes_a_trace_per_rank(tmp_path):
    # 8 steps an epoch: wait 1, warm up 2, record 5 (steps 4-8)
    result = run_cli("run", "--name", "prof", "--nproc-per-node", "2", "--strategy", "ddp",
                     "--max-epochs", "2", "--batch-size", "32", "--no-summary", "-p",
                     "no:progress", "--profile", str(TASK), cwd=tmp_path)
    assert result.returncode == 0, result
    folder = tmp_path / "runs" / "prof" / "profiler"
    files = traces(folder)
    assert sorted(files) == [0, 1]
    for path in files.values():
        names = event_names(path)
        assert names["aten::mm"] > 0  # the backward of the linear layers
        assert names["gloo:all_reduce"] > 0  # DDP's gradient all-reduce over gloo
        steps = sorted(n for n in names if n and n.startswith("ProfilerStep#"))
        assert len(steps) == 5, steps  # --profile-steps 5
    summary = [ln for ln in result.stdout.splitlines() if ln.startswith("Profiler:")]
    assert len(summary) == 1, result  # rank 0 only
    assert summary[0].startswith(
        f"Profiler: steps 4-8 traced on every rank into {os.path.join('runs', 'prof', 'profiler')}"
        "; top ops by self CPU time on rank 0: "), summary
    assert len(summary[0].split("; top ops")[1].split(", ")) == 5  # --profile-top 5


class StepHooks:
    """Records which plugins implement distrun_on_step_end at each step of a fit."""

    def __init__(self) -> None:
        self.owners: dict[int, list[str]] = {}

    @distrun.hookimpl
    def distrun_on_step_end(self, run, step):
        self.owners[step] = sorted(
            getattr(i.plugin, "__name__", type(i.plugin).__module__)
            for i in run.pm.hook.distrun_on_step_end.get_hookimpls())


def _fits(rank: int, world: int, run_dir: str) -> dict:
    sys.path.insert(0, str(TASK.parent))
    from tiny_task import TinyTask

    out = {}
    for on in (False, True):
        hooks = StepHooks()
        distrun.Trainer(plugins=(hooks,), profile=on, profile_top=0, max_steps=12, max_epochs=2,
                        batch_size=32, summary=False, run_dir=os.path.join(run_dir, str(on)),
                        console=False).fit(TinyTask())
        out[on] = hooks.owners
    return out


def test_off_adds_no_step_hook_and_on_lets_go_after_its_steps(tmp_path):
    off, on = run_on_ranks(_fits, 1, str(tmp_path))[0].values()
    mine = "distrun_profiler.profiling"
    assert not any(mine in owners or "distrun_profiler.plugin" in owners
                   for owners in off.values())
    assert not (tmp_path / "False" / "profiler").exists()
    # on: stepped for wait 1 + warmup 2 + 5 recorded steps, then unregistered (at step 8 it
    # may be gone already: it lets go in its own hook, which can run before the recorder's)
    present = [s for s, owners in sorted(on.items()) if mine in owners]
    assert present in (list(range(1, 8)), list(range(1, 9))), present
    assert sorted(on) == list(range(1, 13))
    assert len(list((tmp_path / "True" / "profiler").glob("*.pt.trace.json"))) == 1


@pytest.mark.slow
def test_a_fit_that_ends_while_recording_keeps_its_trace(tmp_path):
    result = run_cli("run", "--name", "short", "--max-steps", "6", "--batch-size", "32",
                     "--no-summary", "-p", "no:progress", "--profile", "--profile-wait", "0",
                     "--profile-warmup", "1", "--profile-steps", "10", "--profile-shapes",
                     "--profile-dir", str(tmp_path / "traces"), "--profile-top", "2",
                     str(TASK), cwd=tmp_path)
    assert result.returncode == 0, result
    (path,) = traces(tmp_path / "traces").values()
    data = json.loads(path.read_text())
    assert any("Input Dims" in e.get("args", {}) for e in data["traceEvents"])  # shapes
    summary = [ln for ln in result.stdout.splitlines() if ln.startswith("Profiler:")]
    assert summary and summary[0].startswith("Profiler: steps 2-6 traced on every rank"), result
    assert len(summary[0].split("; top ops")[1].split(", ")) == 2


@pytest.mark.slow
def test_a_fit_too_short_to_record_says_so(tmp_path):
    result = run_cli("run", "--name", "tiny", "--max-steps", "2", "--batch-size", "32",
                     "--no-summary", "-p", "no:progress", "--profile", str(TASK), cwd=tmp_path)
    assert result.returncode == 0, result
    assert ("warning: the profiler traced nothing: the fit ended after 2 step(s), before the "
            "first recorded one (--profile-wait 1 + --profile-warmup 2)") in result.output
    assert not list((tmp_path / "runs" / "tiny").glob("profiler/*.json"))
