"""distrun-wandb: real 2-rank runs in W&B's offline mode, read back from the run's record log."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distrun._launch.lifeline import die_with_parent
from distrun._loggers.csv_file import read_metrics
from distrun.testing import run_cli

pytest.importorskip("wandb", reason="distrun-wandb needs wandb")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from wandb_records import OfflineRun, offline_runs  # noqa: E402

TASK = str(Path(__file__).resolve().parents[2] / "core" / "tiny_task.py")
#: two ranks over DDP, a log row every 2 steps; other loggers blocked to keep runs short
COMMON = ("--nproc-per-node", "2", "--strategy", "ddp", "--batch-size", "32",
          "--log-every-n-steps", "2", "--no-summary", "-p", "no:mlflow", "-p", "no:tensorboard",
          "-p", "no:progress")


def _offline_env(mp: pytest.MonkeyPatch, home: Path) -> None:
    """No mode set by the user (the plugin's default applies), W&B's own folders in ``home``.
    A suite may turn the plugin off by environment: its variables go too."""
    for name in [n for n in os.environ if n.startswith("DISTRUN_WANDB")]:
        mp.delenv(name)
    mp.setenv("DISTRUN_WANDB", "1")  # the plugin is off unless asked for: --wandb
    for name in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_ID", "WANDB_API_KEY",
                 "WANDB_DIR"):
        mp.delenv(name, raising=False)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        mp.setenv(name, str(home / name.lower()))


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    _offline_env(monkeypatch, tmp_path / "wandb-home")


def csv_column(run_dir: Path, key: str) -> dict[int, float]:
    return {int(r["step"]): r[key] for r in read_metrics(str(run_dir / "metrics.csv"))
            if key in r}


def logged(run: OfflineRun, key: str) -> dict[int, float]:
    return {row["_step"]: row[key] for row in run.history if key in row}


def core_pid_and_log(run: OfflineRun) -> tuple[int, str]:
    """The pid wandb-core served (the rank-0 worker) and wandb-core's own log."""
    text = (run.folder / "logs" / "debug-core.log").read_text()
    return json.loads(text.splitlines()[0])["pid"], text


def wandb_core_serving(pid: int) -> list[str]:
    """Command lines of live wandb-core processes started for ``pid``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and argv and argv[0].endswith(b"wandb-core") \
                and str(pid).encode() in argv:
            found.append(b" ".join(argv).decode())
    return found


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wandb")
    with pytest.MonkeyPatch.context() as mp:
        _offline_env(mp, tmp / "wandb-home")
        result = run_cli("run", *COMMON, "--name", "fit", "--max-epochs", "2",
                         "--wandb-tags", "baseline, ddp", TASK, cwd=tmp)
    assert result.returncode == 0, result
    return tmp / "runs" / "fit"


def test_offline_run_read_back_from_its_record_log(finished):
    (run,) = offline_runs(finished)  # offline by default, under RUN_DIR/wandb
    saved = json.loads((finished / "wandb_run.json").read_text())
    assert (run.run_id, run.project, run.name) == (saved["id"], "distrun", "fit")
    assert saved["mode"] == "offline"
    assert run.tags == ["baseline", "ddp"]
    assert run.exit_code == 0
    # 256 samples / 32 = 8 steps an epoch, 2 epochs, a row every 2 steps: the numbers of the
    # core's metrics.csv at the same steps (the CSV keeps 8 significant digits).
    loss = logged(run, "loss")
    assert list(loss) == [2, 4, 6, 8, 10, 12, 14, 16]
    assert loss == {step: pytest.approx(value, rel=1e-7)
                    for step, value in csv_column(finished, "loss").items()}
    assert list(logged(run, "val_loss")) == [8, 16]
    assert run.summary["loss"] == pytest.approx(loss[16])  # the final loss
    assert "step" not in run.summary  # the step is W&B's own _step
    assert run.config["strategy"] == "ddp"
    assert run.config["max_epochs"] == 2 and run.config["batch_size"] == 32
    assert run.config["distrun"]["world_size"] == 2
    assert run.config["distrun"]["strategy"] == "ddp"


def test_the_plot_is_an_image_of_the_last_step(finished):
    (run,) = offline_runs(finished)
    (row,) = [r for r in run.history if "metrics_plot._type" in r]
    assert row["_step"] == 16 and row["metrics_plot._type"] == "image-file"
    png = run.folder / "files" / row["metrics_plot.path"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_wandb_core_ended_with_the_worker(finished):
    (run,) = offline_runs(finished)
    pid, core_log = core_pid_and_log(run)
    assert "server: is shutting down" in core_log
    deadline = time.monotonic() + 10
    while wandb_core_serving(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert wandb_core_serving(pid) == []


def test_plugin_module_imports_neither_torch_nor_wandb():
    code = ("import sys, distrun_wandb.plugin; "
            "print(sorted(m for m in ('torch', 'wandb') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_mode_auto_follows_wandb_mode(monkeypatch):
    from distrun_wandb.logger import mode_of
    from distrun_wandb.options import WandbOptions

    config = WandbOptions(wandb=True, wandb_mode="auto")
    assert mode_of(config) == "offline"
    monkeypatch.setenv("WANDB_MODE", "online")
    assert mode_of(config) == "online"
    assert mode_of(WandbOptions(wandb=True, wandb_mode="disabled")) == "disabled"
    assert mode_of(WandbOptions(wandb_mode="online")) == "disabled"  # off unless --wandb


def test_bad_mode_is_a_usage_error(cli, tmp_path):
    result = cli("run", "--wandb-mode", "ofline", f"{TASK}:TinyTask", cwd=tmp_path)
    assert result.returncode == 2, result
    assert "--wandb-mode: 'ofline'; did you mean 'offline'?" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result


@pytest.mark.slow
def test_disabled_writes_nothing(tmp_path, monkeypatch):
    flag = run_cli("run", *COMMON, "--name", "flag", "--max-steps", "2", "--wandb-mode",
                   "disabled", TASK, cwd=tmp_path)
    assert flag.returncode == 0, flag
    monkeypatch.setenv("WANDB_MODE", "disabled")  # the user's own setting, under auto
    env = run_cli("run", *COMMON, "--name", "env", "--max-steps", "2", TASK, cwd=tmp_path)
    assert env.returncode == 0, env
    for name in ("flag", "env"):
        assert not (tmp_path / "runs" / name / "wandb").exists()
        assert not (tmp_path / "runs" / name / "wandb_run.json").exists()
    assert "wandb:" not in flag.output + env.output


@pytest.mark.slow
def test_a_failing_run_finishes_with_exit_code_1(tmp_path):
    # Both ranks raise at micro-step 13, in the second epoch (the first epoch's rows are in).
    result = run_cli("run", *COMMON, "--name", "bad", "--max-epochs", "2", TASK,
                     cwd=tmp_path, env={"TINY_RAISE_AT": "13"})
    assert result.returncode != 0, result
    assert "boom at micro-step 13" in result.output
    run_dir = tmp_path / "runs" / "bad"
    (run,) = offline_runs(run_dir)
    assert run.exit_code == 1
    loss = logged(run, "loss")
    assert {2, 4, 6, 8} <= set(loss) and max(loss) < 13
    assert loss == {step: pytest.approx(value, rel=1e-7)
                    for step, value in csv_column(run_dir, "loss").items()}
    assert not any("metrics_plot._type" in row for row in run.history)


@pytest.mark.slow
def test_a_preempted_run_is_marked_and_exits_143(tmp_path):
    name = "pre"
    proc = subprocess.Popen(
        [sys.executable, "-m", "distrun", "run", *COMMON, "--name", name, "--max-epochs",
         "1000", TASK], cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=die_with_parent())
    csv_path = tmp_path / "runs" / name / "metrics.csv"
    try:
        deadline = time.monotonic() + 120
        while not (csv_path.exists() and len(read_metrics(str(csv_path))) >= 3):
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "no metrics rows within 120 s"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # as a scheduler does
        out = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    assert proc.returncode == 143, out
    (run,) = offline_runs(tmp_path / "runs" / name)
    assert run.preempting and run.exit_code == 143
    assert any("metrics_plot._type" in row for row in run.history)


@pytest.mark.slow
def test_resume_continues_the_same_run_id(tmp_path):
    pytest.importorskip("distrun_safetensors", reason="resuming needs a checkpoint plugin")
    # no end checkpoint: the resume starts behind the last logged step, as after a crash
    first = run_cli("run", *COMMON, "--name", "r", "--max-steps", "8",
                    "--ckpt-every-n-steps", "3", "--no-ckpt-save-on-end", TASK, cwd=tmp_path)
    assert first.returncode == 0, first
    second = run_cli("run", *COMMON, "--name", "r", "--max-steps", "12", "--resume", "auto",
                     TASK, cwd=tmp_path)
    assert second.returncode == 0, second
    run_dir = tmp_path / "runs" / "r"
    before, after = offline_runs(run_dir)  # `wandb sync` uploads both into one run, in order
    assert before.run_id == after.run_id == json.loads((run_dir / "wandb_run.json")
                                                       .read_text())["id"]
    assert list(logged(before, "loss")) == [2, 4, 6, 8]
    # resumed at step 6: the second part logs from step 8 on, as metrics.csv now has it
    assert list(logged(after, "loss")) == [8, 10, 12]
    assert logged(after, "loss") == {s: pytest.approx(v, rel=1e-7)
                                     for s, v in csv_column(run_dir, "loss").items() if s > 6}
    assert after.config["max_steps"] == 12
    assert after.config["distrun"]["resumed_from"].endswith("step-6")
