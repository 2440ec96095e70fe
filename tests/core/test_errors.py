"""User mistakes: exit 2, one line saying what is wrong and how to fix it, no traceback.

Launcher-side mistakes run in-process (the `cli` fixture); `--debug` (the interpreter prints the
traceback) and a worker-side error keep a real `distrun` subprocess."""

from __future__ import annotations

import socket

import pytest

from distrun.testing import run_cli


def one_line_error(result) -> str:
    assert result.returncode == 2, result
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, result
    assert "Traceback" not in result.output
    assert lines[0].startswith("error: ")
    return lines[0]


def test_unknown_strategy_suggests_and_says_how_to_install(cli, tiny_script):
    # Block ddp in case it is installed, so the install hint shows as it would without it.
    line = one_line_error(cli("-p", "no:ddp", "run", "--strategy", "ddpp", tiny_script))
    assert "unknown strategy 'ddpp'; did you mean 'ddp'?" in line
    assert "Installed: " in line and "single" in line
    assert line.endswith("Install it with: pip install distrun-ddp")


def test_unknown_strategy_without_close_name(cli, tiny_script):
    line = one_line_error(cli("run", "--strategy", "zzz", tiny_script))
    assert "unknown strategy 'zzz' Installed:" in line


def test_missing_script(cli):
    line = one_line_error(cli("run", "no_such_script.py"))
    assert line == "error: script not found: no_such_script.py (check the path)"


def test_missing_task_file(cli):
    line = one_line_error(cli("run", "nope.py:Task"))
    assert "task file not found: nope.py" in line


def test_bad_toml(cli, tmp_path, tiny_script):
    bad = tmp_path / "run.toml"
    bad.write_text("max_epochs = = 3\n")
    line = one_line_error(cli("run", "--config", str(bad), tiny_script))
    assert f"config file {bad} is not valid TOML" in line


def test_unknown_config_key_names_key_and_file(cli, tmp_path, tiny_script):
    cfg = tmp_path / "run.toml"
    cfg.write_text("max_epoch = 3\n")
    line = one_line_error(cli("run", "--config", str(cfg), tiny_script))
    assert f"unknown key 'max_epoch' in {cfg}; did you mean 'max_epochs'?" in line


def test_missing_config_file(cli, tiny_script):
    line = one_line_error(cli("run", "--config", "nope.toml", tiny_script))
    assert "config file not found: nope.toml" in line


@pytest.mark.parametrize("flags, expected", [
    (["--max-epochs", "abc"], "invalid value for --max-epochs: 'abc' is not a whole number"),
    (["--batch-size", "0"], "invalid value for --batch-size: 0 is below the minimum 1"),
    (["--timeout", "fast"], "invalid value for --timeout: 'fast' is not a number"),
    (["--device", "tpu"], "invalid value for --device: 'tpu'"),
    (["--nproc-per-node", "0"], "invalid value for --nproc-per-node"),
    (["--nnodes", "2", "--node-rank", "5"], "--node-rank 5 is out of range for --nnodes 2"),
])
def test_invalid_numbers_and_choices(cli, tiny_script, flags, expected):
    line = one_line_error(cli("run", *flags, tiny_script))
    assert expected in line


def test_invalid_env_value_names_the_variable(cli, tiny_script):
    line = one_line_error(cli("run", tiny_script, env={"DISTRUN_MAX_EPOCHS": "two"}))
    assert "'max_epochs' in DISTRUN_MAX_EPOCHS" in line


def test_unknown_flag_of_a_plugin_says_which_plugin(cli, tiny_script):
    line = one_line_error(cli("-p", "no:elastic", "run", "--max-restarts", "3", tiny_script))
    assert "--max-restarts comes with distrun-elastic: pip install distrun-elastic" in line


def test_port_in_use(cli, tiny_script):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        line = one_line_error(cli("run", "--master-port", str(port), tiny_script))
    assert f"port {port} on 127.0.0.1 is in use" in line
    assert "--master-port" in line


def test_single_strategy_on_two_processes(cli, tiny_script):
    line = one_line_error(cli("run", "--nproc-per-node", "2", "--strategy", "single",
                              tiny_script))
    assert "strategy 'single' runs in one process but 2 were asked for" in line


def test_debug_shows_the_traceback(tiny_script):
    result = run_cli("--debug", "run", "--strategy", "zzz", tiny_script)
    assert result.returncode != 0
    assert "Traceback" in result.stderr and "UsageError" in result.stderr


@pytest.mark.slow
def test_worker_side_usage_error_is_said_once(tmp_path, tiny_script):
    # The batch does not split over 3 data ranks: every rank finds it, the user reads it once.
    result = run_cli("run", "--nproc-per-node", "3", "--batch-size", "32", tiny_script,
                     cwd=tmp_path, env={"DISTRUN_STRATEGY": "auto"})
    if "need a data-parallel strategy" in result.stderr:
        pytest.skip("no multi-process strategy installed in this environment")
    # on fewer than 3 cores the launcher first warns that the ranks take turns on them
    result.stderr = "".join(ln for ln in result.stderr.splitlines(keepends=True)
                            if not ln.startswith("warning: 3 worker processes on "))
    line = one_line_error(result)
    assert "batch_size 32 is not divisible by 3 data-parallel ranks" in line
