"""Hooks fire in the documented order, and every hookspec is documented and exercised."""

from __future__ import annotations

import inspect
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from distrun._spec import hookspecs
from distrun.testing import run_cli

SPEC_NAMES = sorted(n for n, f in vars(hookspecs).items()
                    if n.startswith("distrun_") and callable(f))
#: hooks that answer a question whenever one is asked (not a phase of the run)
QUERIES = ("continues_run", "parallel_degrees", "resume_words")
HERE = Path(__file__).resolve().parent
TINY = str(HERE / "tiny_task.py")

#: the recorded runs of this module: name -> (flags, extra environment)
RUNS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "order": (("--max-steps", "5", "--log-every-n-steps", "2", "--val-every-n-steps", "4",
               "--grad-accum", "2", "--resume", "auto"), {}),
    "epochs": (("--max-epochs", "2", "--batch-size", "64"), {}),
    "exception": ((), {"TINY_RAISE_AT": "3"}),
    "preempt": (("--max-epochs", "3"), {"TINY_SIGTERM_AT": "3"}),
}


def records(folder: Path) -> list[dict]:
    out = []
    for path in sorted(folder.glob("*.jsonl")):
        out += [json.loads(line) for line in path.read_text().splitlines()]
    return out


def squeeze(names: list[str]) -> list[str]:
    """Collapse consecutive repeats so the sequence reads like the documented order."""
    out: list[str] = []
    for n in names:
        if not out or out[-1] != n:
            out.append(n)
    return out


def short(name: str) -> str:
    return name.removeprefix("distrun_")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple]:
    """``recorded(name)``: the ``distrun run`` of ``RUNS[name]`` under the recorder plugin,
    as ``(result, records)``; each run happens once per module, whichever test asks first."""
    cache: dict[str, tuple] = {}

    def get(name: str) -> tuple:
        if name not in cache:
            flags, extra_env = RUNS[name]
            cwd = tmp_path_factory.mktemp(f"hooks_{name}")
            rec = cwd / "rec"
            rec.mkdir()
            env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
                   "DISTRUN_PLUGINS": "recorder_plugin", "RECORD_DIR": str(rec), **extra_env}
            result = run_cli("run", "--run-dir", str(cwd / "run"), *flags, TINY, cwd=cwd,
                             env=env)
            cache[name] = result, records(rec)
        return cache[name]

    return get


def test_hooks_fire_in_documented_order(recorded):
    result, recs = recorded("order")
    assert result.returncode == 0, result
    launcher = [short(r["hook"]) for r in recs if r["rank"] == -1]
    worker = [short(r["hook"]) for r in recs if r["rank"] == 0]
    # Launcher: the CLI is built from the registration hooks, then detect, then launch.
    assert launcher.index("detect_cluster") < launcher.index("launch")
    # Detected once per launch; the launchers are handed the answer (the core's "local").
    assert launcher.count("detect_cluster") == 1, launcher
    assert [r["cluster"] for r in recs if r["hook"] == "distrun_launch"] == ["local"]
    assert set(launcher[: launcher.index("detect_cluster")]) >= {"add_commands",
                                                                 "register_options"}
    # Query hooks, asked wherever a config is resolved or a layout read, are not phases.
    seq = squeeze([h for h in worker if h not in QUERIES])
    expected_setup = ["register_options", "configure", "register_strategies", "setup_strategy",
                      "checkpoint_found", "setup_model", "setup_optimizer", "setup_data", "load_checkpoint",
                      "state_dict", "load_state_dict", "on_fit_start",
                      "run_validation",  # the sanity pass (num_sanity_val_steps)
                      "run_fit", "run_epoch"]
    assert seq[: len(expected_setup)] == expected_setup, seq
    body = " ".join(seq)
    # Each optimizer step: (training_step -> backward) x 2 micro-batches -> optimizer_step.
    assert re.search(r"training_step backward optimizer_step on_step_end", body), body
    assert [r["step"] for r in recs if r["hook"] == "distrun_on_step_end"] == [1, 2, 3, 4, 5]
    assert sum(r["hook"] == "distrun_training_step" for r in recs if r["rank"] == 0) == 10
    assert re.search(r"on_step_end log_metrics", body)
    assert re.search(r"run_validation on_validation_end log_metrics", body)
    # the fit ended normally: the checkpoint plugin saves its last step (the default)
    assert seq[-5:] == ["run_fit:end", "on_fit_end", "save_checkpoint", "state_dict",
                        "teardown"], seq
    assert [r["reason"] for r in recs if r["hook"] == "distrun_save_checkpoint"] == ["end"]
    # max_steps stops mid-epoch: the epoch returns, the rest of the window is logged and a
    # final validation runs, all inside run_fit.
    assert re.search(r"run_epoch:end log_metrics run_validation on_validation_end log_metrics "
                     r"run_fit:end", body), body
    # Plain setup_model implementations see the user's module, before any strategy wrap.
    assert [r["type"] for r in recs if r["hook"] == "distrun_setup_model"] == ["Sequential"]
    assert [r["source"] for r in recs if r["hook"] == "distrun_load_checkpoint"] == ["auto"]
    # asked before the model is built: the recorder's answer (None) leaves its init as it is
    assert [r["source"] for r in recs if r["hook"] == "distrun_checkpoint_found"] == ["auto"]
    names = next(r["names"] for r in recs if r["hook"] == "distrun_load_state_dict")
    assert {"progress", "rng", "sampler", "recorder"} <= set(names)


@pytest.mark.slow
def test_epoch_end_and_fit_end_order(recorded):
    result, recs = recorded("epochs")
    assert result.returncode == 0, result
    seq = squeeze([short(r["hook"]) for r in recs if r["rank"] == 0])
    assert [r["epoch"] for r in recs if r["hook"] == "distrun_on_epoch_end"] == [0, 1]
    # Validation closes each epoch before on_epoch_end.
    body = " ".join(seq)
    assert body.count("run_validation on_validation_end log_metrics on_epoch_end") == 2, body
    assert "load_checkpoint" not in seq  # --resume never (the default) loads nothing


def test_exception_hook_and_exit_code(recorded):
    result, recs = recorded("exception")
    assert result.returncode == 1, result
    assert "boom at micro-step 3" in result.stderr
    assert "rank 0 failed with exit code 1" in result.stderr
    seq = [short(r["hook"]) for r in recs if r["rank"] == 0]
    assert seq[-2:] == ["on_exception", "teardown"], seq
    assert "on_fit_end" not in seq


@pytest.mark.slow
def test_preempt_saves_and_exits_for_requeue(recorded):
    result, recs = recorded("preempt")
    assert result.returncode == 143, result
    seq = [short(r["hook"]) for r in recs if r["rank"] == 0]
    i = seq.index("on_preempt")
    assert seq[i + 1:i + 3] == ["save_checkpoint", "state_dict"], seq
    assert [r["reason"] for r in recs if r["hook"] == "distrun_save_checkpoint"] == ["preempt"]
    # It stopped right after the signal instead of finishing 3 epochs (8 steps each).
    steps = [r["step"] for r in recs if r["hook"] == "distrun_on_step_end"]
    assert steps == [1, 2, 3], steps
    assert "on_fit_end" not in seq and seq[-1] == "teardown"


def test_every_hookspec_is_documented():
    for name in SPEC_NAMES:
        doc = inspect.getdoc(getattr(hookspecs, name)) or ""
        assert len(doc.splitlines()[0]) > 10, f"{name} has no one-line summary"
        assert any(w in doc.lower() for w in ("rank", "launcher")), \
            f"{name}'s docstring does not say where it is called"


def test_recorder_implements_every_hookspec():
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    import recorder_plugin

    missing = [n for n in SPEC_NAMES if not hasattr(recorder_plugin, n)]
    assert not missing, f"recorder_plugin lacks {missing}"


@pytest.mark.slow  # it needs every recorded run, the slow ones included
def test_every_hookspec_is_exercised(recorded):
    """Meta-test: the module's runs call every hook (a new spec needs a run that fires it)."""
    exercised = {r["hook"].split(":")[0] for name in RUNS for r in recorded(name)[1]}
    missing = sorted(set(SPEC_NAMES) - exercised)
    assert not missing, f"hookspecs no test exercised: {missing}"
