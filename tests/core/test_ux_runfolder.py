"""The run folder, the console line and metrics.csv, seen through real `distrun run` runs."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from distrun.testing import run_cli

TINY = str(Path(__file__).resolve().parent / "tiny_task.py")
# tiny_task: 256 samples; --batch-size 32 -> 8 steps per epoch, validation at each epoch end.
FLAGS = ("-p", "no:progress", "run", "--max-epochs", "2", "--batch-size", "32",
         "--log-every-n-steps", "4", "--no-summary")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One run of the tiny task: (folder, result)."""
    cwd = tmp_path_factory.mktemp("rf")
    result = run_cli(*FLAGS, "--name", "tiny", "--seed", "3", TINY, cwd=cwd,
                     env={"DISTRUN_GRAD_CLIP": "1.5"})
    assert result.returncode == 0, result
    return cwd / "runs" / "tiny", result


def test_console_prints_a_plain_line_per_log_step(tiny_run):
    _, result = tiny_run
    lines = re.findall(r"^epoch (\d) \| step (\d+) \| loss ([0-9.]+) \| ([0-9.]+) samples/s "
                       r"\| lr 5\.000e-02$", result.stdout, re.M)
    assert [(e, s) for e, s, *_ in lines] == [("0", "4"), ("0", "8"), ("1", "12"), ("1", "16")]
    assert all(float(rate) > 0 for *_, rate in lines)
    assert len(re.findall(r"^step (8|16) \| val_loss [0-9.]+$", result.stdout, re.M)) == 2


def test_metrics_csv_matches_the_console(tiny_run):
    folder, result = tiny_run
    with open(folder / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0])[:3] == ["step", "epoch", "time"]
    train = [r for r in rows if r["loss"]]
    val = [r for r in rows if r["val_loss"]]
    assert [int(r["step"]) for r in train] == [4, 8, 12, 16]
    assert [int(r["step"]) for r in val] == [8, 16]
    printed = [float(x) for x in re.findall(r"\| loss ([0-9.]+) \|", result.stdout)]
    assert printed == pytest.approx([float(r["loss"]) for r in train], abs=1e-4)
    assert all(float(r["lr"]) == 0.05 and float(r["samples_per_sec"]) > 0 for r in train)
    times = [float(r["time"]) for r in rows]
    assert times == sorted(times)


def test_config_toml_has_every_value_and_its_source(tiny_run):
    folder, _ = tiny_run
    text = (folder / "config.toml").read_text()
    assert re.search(r"^seed = 3  # flag$", text, re.M)
    assert re.search(r"^grad_clip = 1\.5  # DISTRUN_GRAD_CLIP$", text, re.M)
    # Defaults show commented out, so loading the file back pins only what was set.
    assert re.search(r"^# max_steps = -1  # default$", text, re.M)
    assert re.search(r"^# console = true  # default$", text, re.M)
    assert re.search(r'^run_dir = "runs/tiny"', text, re.M)
    data = tomllib.loads(text)
    assert data["seed"] == 3 and data["max_epochs"] == 2 and data["grad_clip"] == 1.5
    assert "max_steps" not in data and "console" not in data


def test_config_toml_loads_back_as_the_same_run(cli, tiny_run, tmp_path):
    folder, _ = tiny_run
    result = cli("config", "show", "--config", str(folder / "config.toml"), "--json",
                     cwd=tmp_path)
    assert result.returncode == 0, result
    shown = json.loads(result.stdout)
    assert shown["seed"] == {"value": 3, "source": str(folder / "config.toml")}
    assert shown["grad_clip"]["value"] == 1.5
    assert shown["batch_size"]["value"] == 32


def test_logs_per_rank(tmp_path):
    script = tmp_path / "plain.py"  # a torchrun-style script: no Trainer at all
    script.write_text("import os, sys\nrank = os.environ['RANK']\nprint(f'hello from {rank}')\n"
                      "print(f'warn {rank}', file=sys.stderr)\n")
    result = run_cli("run", "--nproc-per-node", "2", "--name", "two", str(script), cwd=tmp_path)
    assert result.returncode == 0, result
    logs = tmp_path / "runs" / "two" / "logs"
    for rank in (0, 1):
        text = (logs / f"rank{rank}.log").read_text()
        assert f"hello from {rank}\n" in text and f"warn {rank}\n" in text
        assert f"hello from {1 - rank}" not in text
    # The launcher wrote the config for a script that never builds one itself.
    assert "nproc_per_node = 2  # flag" in (tmp_path / "runs" / "two" / "config.toml").read_text()


def test_no_console_and_no_csv(tmp_path):
    result = run_cli("-p", "no:progress", "run", "--max-steps", "4", "--log-every-n-steps", "2",
                     "--no-console", "--no-csv", "--run-dir", "out", "--no-summary", TINY,
                     cwd=tmp_path)
    assert result.returncode == 0, result
    assert "loss" not in result.stdout
    # The task script sets max_epochs and batch_size in code: rank 0 marks them in the file.
    text = (tmp_path / "out" / "config.toml").read_text()
    assert "\nmax_epochs = 2  # code\n" in text and "\nbatch_size = 32  # code\n" in text
    assert "\nmax_steps = 4  # flag\n" in text
    assert not (tmp_path / "out" / "metrics.csv").exists()


@pytest.mark.slow
def test_direct_python_run_writes_its_folder(tmp_path):
    """`python train.py` (no launcher): rank 0 writes config.toml and metrics.csv itself."""

    env = {"DISTRUN_RUN_DIR": str(tmp_path / "direct"), "DISTRUN_MAX_STEPS": "4",
           "DISTRUN_LOG_EVERY_N_STEPS": "2", "DISTRUN_BLOCK_PLUGINS": "progress",
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, TINY], cwd=tmp_path, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "direct" / "config.toml").read_text()
    assert "max_steps = 4  # DISTRUN_MAX_STEPS" in text
    assert "max_epochs = 2  # code" in text
    with open(tmp_path / "direct" / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    # Two log steps, then the final validation.
    assert [(r["step"], bool(r["loss"]), bool(r["val_loss"])) for r in rows] == [
        ("2", True, False), ("4", True, False), ("4", False, True)]


@pytest.mark.slow
def test_resume_keeps_metrics_csv_as_one_run(tmp_path):
    pytest.importorskip("distrun_safetensors", reason="resuming needs a checkpoint plugin")
    common = ("-p", "no:progress", "run", "--name", "r", "--batch-size", "32",
              "--log-every-n-steps", "2", "--no-summary")
    # no end checkpoint: the resume starts behind the last logged step, as after a crash
    first = run_cli(*common, "--max-steps", "8", "--ckpt-every-n-steps", "3",
                    "--no-ckpt-save-on-end", TINY, cwd=tmp_path)
    assert first.returncode == 0, first
    before = (tmp_path / "runs" / "r" / "metrics.csv").read_text().splitlines()
    second = run_cli(*common, "--max-steps", "12", "--resume", "auto", TINY, cwd=tmp_path)
    assert second.returncode == 0, second
    assert "Resumed from" in second.stdout and "at step 6" in second.stdout
    # the first run logged steps 8 (loss) and 8 (val_loss) after the checkpoint of step 6
    ckpt = os.path.join("runs", "r", "checkpoints", "step-6")
    assert second.stdout.count("metrics.csv: replacing") == 1, second.stdout
    assert (f"metrics.csv: replacing 2 rows of step 8: the run went back to step 6 (resumed "
            f"from {ckpt})") in second.stdout
    with open(tmp_path / "runs" / "r" / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    # each step once: one row of train metrics, one of validation metrics
    kinds = [(r["step"], bool(r["loss"])) for r in rows]
    assert len(kinds) == len(set(kinds)), rows
    # Steps 2..6 kept from the first run, 8 written again by the resumed run, no duplicates.
    train = [int(r["step"]) for r in rows if r["loss"]]
    assert train == [2, 4, 6, 8, 10, 12]
    assert [int(r["step"]) for r in rows if r["val_loss"]] == [8, 12]
    # The replayed step 8 logs the same loss as the first run did (bit-exact resume).
    first_8 = next(r for r in csv.DictReader(before) if r["step"] == "8" and r["loss"])
    again_8 = next(r for r in rows if r["step"] == "8" and r["loss"])
    assert first_8["loss"] == again_8["loss"]
