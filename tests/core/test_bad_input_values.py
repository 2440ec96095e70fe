"""Bad values of issue 36: non-finite numbers, names no folder should carry, run folders the
system refuses and a run folder whose disk is full.

Values refused when the options are read run in-process (the ``cli`` fixture: no worker may
start); each item also runs once as the issue's repro did, a real ``distrun run``.
"""

from __future__ import annotations

import ast
import importlib.util
import os
from pathlib import Path

import pytest
import tomllib

from distrun.testing import run_cli, small_disk

SCRIPT = 'import os\nprint("trained", os.environ["RANK"])\n'
TASK = """
import torch
import distrun


class T(distrun.Task):
    def configure_model(self):
        return torch.nn.Linear(2, 1)

    def train_data(self):
        g = torch.Generator().manual_seed(0)
        return torch.utils.data.TensorDataset(torch.randn(64, 2, generator=g),
                                              torch.randn(64, 1, generator=g))

    def training_step(self, model, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)
"""
NO_BAR = ("-p", "no:progress") if importlib.util.find_spec("distrun_progress") else ()


def _needs(*packages: str) -> None:
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")


def _finite(where: str, value: str, example: str) -> str:
    return (f"error: invalid value for {where}: {value} is not a finite number; give a plain "
            f"number, e.g. {example}")


def _control(where: str, value: str) -> str:
    return (f"error: invalid value for {where}: {value} holds a control character (a newline, "
            "tab or escape); give it on one line in printable characters")


# (args, env, files to make, the one line, plugin packages needed)
CASES = {
    # item 11: nan and inf pass every min/max comparison; each float option, each source
    "timeout_inf": (("--timeout", "inf"), {}, {},
                    _finite("--timeout", "'inf'", "--timeout 300.0"), ()),
    "grad_clip_nan": (("--grad-clip", "nan"), {}, {},
                      _finite("--grad-clip", "'nan'", "--grad-clip 0.0"), ()),
    "timeout_overflows_to_inf": (("--timeout", "1e999"), {}, {},
                                 _finite("--timeout", "'1e999'", "--timeout 300.0"), ()),
    "ft_heartbeat_nan": (("--ft-heartbeat", "nan"), {}, {},
                         _finite("--ft-heartbeat", "'nan'", "--ft-heartbeat 2.0"),
                         ("distrun_ft",)),
    "ft_heartbeat_inf": (("--ft-heartbeat", "inf"), {}, {},
                         _finite("--ft-heartbeat", "'inf'", "--ft-heartbeat 2.0"),
                         ("distrun_ft",)),
    "ddp_bucket_inf": (("--ddp-bucket-mb", "Infinity"), {}, {},
                       _finite("--ddp-bucket-mb", "'Infinity'", "--ddp-bucket-mb 25.0"),
                       ("distrun_ddp",)),
    "rpc_timeout_nan": (("--rpc-timeout", "NaN"), {}, {},
                        _finite("--rpc-timeout", "'NaN'", "--rpc-timeout 60.0"),
                        ("distrun_rpc",)),
    "env_nan": ((), {"DISTRUN_TIMEOUT": "nan"}, {},
                _finite("'timeout' in DISTRUN_TIMEOUT", "'nan'", "--timeout 300.0"), ()),
    "env_plugin_inf": ((), {"DISTRUN_FT_HEARTBEAT": "-inf"}, {},
                       _finite("'ft_heartbeat' in DISTRUN_FT_HEARTBEAT", "'-inf'",
                               "--ft-heartbeat 2.0"), ("distrun_ft",)),
    "toml_inf": (("--config", "run.toml"), {}, {"run.toml": "timeout = inf\n"},
                 _finite("'timeout' in run.toml", "inf", "--timeout 300.0"), ()),
    "toml_plugin_table_nan": (("--config", "run.toml"), {}, {"run.toml": "[ft]\nheartbeat = nan\n"},
                              _finite("'ft_heartbeat' in run.toml", "nan", "--ft-heartbeat 2.0"),
                              ("distrun_ft",)),
    # item 20: a control character in anything that becomes a folder, a file or a line
    "name_newline": (("--name", "a\nb"), {}, {}, _control("--name", "'a\\nb'"), ()),
    "name_escape": (("--name", "run\x1b[2J"), {}, {}, _control("--name", "'run\\x1b[2J'"), ()),
    "name_tab_in_env": ((), {"DISTRUN_NAME": "a\tb"}, {},
                        _control("'name' in DISTRUN_NAME", "'a\\tb'"), ()),
    "name_in_toml": (("--config", "run.toml"), {}, {"run.toml": 'name = "x\\ny"\n'},
                     _control("'name' in run.toml", "'x\\ny'"), ()),
    "run_dir_newline": (("--run-dir", "runs/a\nb"), {}, {},
                        _control("--run-dir", "'runs/a\\nb'"), ()),
    "ckpt_dir_carriage_return": (("--ckpt-dir", "ck\rpt"), {}, {},
                                 _control("--ckpt-dir", "'ck\\rpt'"), ("distrun_safetensors",)),
    # `--name "$RUN"` with RUN unset (in a file "" is the default: `config init` writes it)
    "name_empty": (("--name", ""), {}, {},
                   "error: --name is empty: give a run name, or leave --name out for the "
                   "default (the script's name and the start time)", ()),
}


@pytest.mark.parametrize("target", ["script.py", "task.py:T"])
@pytest.mark.parametrize("case", list(CASES))
def test_bad_values_are_one_line_and_write_nothing(cli, tmp_path, case, target):
    args, env, files, line, needs = CASES[case]
    _needs(*needs)
    (tmp_path / "script.py").write_text(SCRIPT)
    (tmp_path / "task.py").write_text(TASK)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    before = sorted(os.listdir(tmp_path))
    result = cli("run", *args, target, cwd=tmp_path, env={"DISTRUN_BLOCK_PLUGINS": None, **env})
    assert (result.returncode, result.stderr.splitlines()) == (2, [line]), result
    assert "Traceback" not in result.output
    assert sorted(os.listdir(tmp_path)) == before  # no run folder, whole or half


def test_ft_heartbeat_nan_is_refused_before_anything_starts(tmp_path):
    """The issue's repro: reached a derived-timeout message with "nans"."""
    _needs("distrun_ft")
    (tmp_path / "script.py").write_text(SCRIPT)
    result = run_cli(*NO_BAR, "run", "--ft", "--ft-heartbeat", "nan", "script.py", cwd=tmp_path,
                     timeout=60)
    assert (result.returncode, result.stderr.splitlines()) == (
        2, [_finite("--ft-heartbeat", "'nan'", "--ft-heartbeat 2.0")]), result
    assert result.stdout == "" and os.listdir(tmp_path) == ["script.py"]


# item 19: a name the system refuses is refused, not counted as taken forever ------------------


def test_a_run_folder_path_longer_than_path_max_is_one_line(tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    (tmp_path / "runs").mkdir()  # the folder numbering looks into it
    long_dir = str(tmp_path / "/".join(["d" * 200] * 25))  # 5000+ characters
    long_name = "n" * 300  # one component longer than NAME_MAX
    shown = f"{long_dir[:40]}...{long_dir[-30:]}"
    for args, line in [
        (("--run-dir", long_dir), f"error: cannot use the run folder {shown}: File name too "
                                  "long (choose another --run-dir or --name)"),
        (("--name", long_name), f"error: cannot use the run folder runs/{'n' * 35}..."
                                f"{'n' * 30}: File name too long (choose another --run-dir or "
                                "--name)"),
    ]:
        # spun at 100% CPU forever before: the timeout fails the test instead of hanging it
        result = run_cli(*NO_BAR, "run", *args, "script.py", cwd=tmp_path, timeout=60)
        assert (result.returncode, result.stderr.splitlines()) == (2, [line]), result
        assert sorted(os.listdir(tmp_path)) == ["runs", "script.py"]
        assert os.listdir(tmp_path / "runs") == []


@pytest.mark.slow
def test_a_default_run_name_drops_control_characters_of_the_script_name(tmp_path):
    """A script that calls distrun.fit() gets the launcher's default name: its file's."""
    (tmp_path / "t\x1b[2Jx\ny.py").write_text(TASK + "\ndistrun.fit(T())\n")
    result = run_cli(*NO_BAR, "run", "--no-summary", "--max-steps", "1", "t\x1b[2Jx\ny.py",
                     cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result
    (folder,) = os.listdir(tmp_path / "runs")
    assert folder.startswith("t-[2Jx-y-"), folder


# item 20: a full disk under the run folder -----------------------------------------------------


@pytest.fixture
def full_disk(tmp_path: Path):
    """A 64 KiB tmpfs with one page free: a lock record fits, config.toml does not."""
    with small_disk(tmp_path / "disk", "64k", fill=60 * 1024) as disk:
        yield disk


def test_a_disk_too_full_for_the_run_folder_s_lock_is_one_line(tmp_path):
    """Not a page free: the lock record cannot be written, and the other processes of the
    run could not tell the lock is theirs, so the run does not start (one line, exit 2)."""
    (tmp_path / "script.py").write_text(SCRIPT)
    with small_disk(tmp_path / "disk", "64k", fill=64 * 1024) as disk:
        result = run_cli("run", "--run-dir", str(disk / "run"), "script.py", cwd=tmp_path,
                         timeout=60)
        assert result.returncode == 2, result
        assert result.stderr.splitlines() == [
            f"error: cannot lock the run folder {disk / 'run'}: No space left on device "
            f"writing {disk / 'run' / '.distrun-lock'} (free space there, or give this run "
            "another --name or --run-dir)"], result
        assert result.stdout == ""


def test_config_toml_on_a_full_disk_is_one_warning_and_the_run_goes_on(tmp_path, full_disk):
    (tmp_path / "script.py").write_text(SCRIPT)
    run_dir = full_disk / "run"
    result = run_cli(*NO_BAR, "run", "--nproc-per-node", "2", "--run-dir", str(run_dir),
                     "--log-dir", str(tmp_path / "logs"), "script.py", cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result
    assert sorted(result.stdout.splitlines()) == ["trained 0", "trained 1"]
    assert result.stderr.splitlines() == [
        f"warning: cannot write {run_dir}/config.toml: No space left on device; the run goes on "
        "without this record of its options (free space there, or choose another --run-dir)"]
    assert not [p for p in os.listdir(run_dir) if p.startswith("config.toml")]  # no .tmpNNN


# the scaffold's files carry the summary as text ---------------------------------------------


def test_plugin_new_quotes_the_summary_in_every_file(cli, tmp_path):
    summary = 'logs "runs" to C:\\tmp\\new """ and \' too'
    result = cli("plugin", "new", "my_x", "--summary", summary, cwd=tmp_path)
    assert result.returncode == 0, result
    root = tmp_path / "my_x"
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert project["description"] == summary
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))  # a SyntaxError fails the test
        if path.name in ("__init__.py", "plugin.py"):
            assert summary in (ast.get_docstring(tree) or ""), path
    assert f"\n{summary}.\n" in (root / "README.md").read_text()


def test_plugin_new_refuses_a_summary_of_several_lines(cli, tmp_path):
    result = cli("plugin", "new", "my_x", "--summary", "one\n[project]", cwd=tmp_path)
    assert (result.returncode, result.stderr.splitlines()) == (2, [
        "error: --summary 'one\\n[project]' holds a control character (a newline, tab or "
        "escape); give one line in printable characters"]), result
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_a_task_on_a_full_disk_is_warned_about_config_toml_once(tmp_path, full_disk):
    """The launcher's warning only: rank 0, which writes config.toml when the launcher did
    not, does not try (and warn) again."""
    (tmp_path / "task.py").write_text(TASK)
    blocks = [a for p in ("progress", "tensorboard")
              if importlib.util.find_spec(f"distrun_{p}") for a in ("-p", f"no:{p}")]
    ckpt = ("--ckpt-dir", str(tmp_path / "ckpt")) \
        if importlib.util.find_spec("distrun_safetensors") else ()
    run_dir = full_disk / "run"
    result = run_cli(*blocks, "run", "--no-summary", "--max-steps", "2", "--run-dir",
                     str(run_dir), "--log-dir", str(tmp_path / "logs"), *ckpt, "task.py:T",
                     cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result
    assert [ln for ln in result.stderr.splitlines() if "config.toml" in ln] == [
        f"warning: cannot write {run_dir}/config.toml: No space left on device; the run goes on "
        "without this record of its options (free space there, or choose another --run-dir)"]
    assert not [p for p in os.listdir(run_dir) if p.startswith("config.toml")]


def test_config_init_on_a_full_disk_is_one_line_and_leaves_nothing(cli, full_disk):
    result = cli("config", "init", "-o", "run.toml", cwd=full_disk)
    assert (result.returncode, result.stderr.splitlines()) == (2, [
        "error: cannot write run.toml: No space left on device (choose another -o path, or "
        "-o - to print it)"]), result
    assert os.listdir(full_disk) == ["filler"]
