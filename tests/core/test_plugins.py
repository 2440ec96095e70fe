"""Plugin discovery: an entry point installed from a folder is found, runs, and can be blocked."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import distrun
from distrun.testing import run_cli

PLUGIN_PY = '''
"""A third-party plugin: a strategy, an option and a hook that writes a marker file."""
import os
from distrun._spec.options import Option  # the older declaration form, kept working
from distrun.plugin import StrategyInfo, hookimpl


def _factory(config):
    from distrun.plugin import BaseStrategy

    class Hello(BaseStrategy):
        name = "hello"

    return Hello(config)


@hookimpl
def distrun_register_strategies(register):
    register(StrategyInfo("hello", _factory, help="says hello", plugin="hello",
                          multi_process=False))


@hookimpl
def distrun_register_options(register):
    register(Option("hello_greeting", str, "hi", help="what to say", plugin="hello"))


@hookimpl
def distrun_on_fit_start(run):
    with open(os.environ["HELLO_MARKER"], "w") as fh:
        fh.write(f"{run.strategy.name}:{run.config.get('hello_greeting')}")
'''


@pytest.fixture(scope="module")
def installed_plugin(tmp_path_factory) -> Path:
    """pip-install a real distribution with a `distrun` entry point into a private folder."""
    src = tmp_path_factory.mktemp("hello_src")
    (src / "distrun_hello").mkdir()
    (src / "distrun_hello" / "__init__.py").write_text("")
    (src / "distrun_hello" / "plugin.py").write_text(PLUGIN_PY)
    (src / "pyproject.toml").write_text(textwrap.dedent("""
        [build-system]
        requires = ["setuptools>=64"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "distrun-hello"
        version = "1.2.3"
        [project.entry-points.distrun]
        hello = "distrun_hello.plugin"
        [tool.setuptools.packages.find]
        include = ["distrun_hello*"]
    """))
    target = tmp_path_factory.mktemp("hello_site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--target", str(target), str(src)],
                   check=True, capture_output=True, timeout=300)
    return target


def env_with(site: Path, **extra: str) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
            **extra}


def test_external_plugin_is_discovered_and_listed(installed_plugin):
    result = run_cli("plugins", env=env_with(installed_plugin))
    assert result.returncode == 0, result
    assert "hello 1.2.3 (distrun-hello)" in result.stdout
    assert "    distrun_on_fit_start" in result.stdout
    strategies = run_cli("strategies", env=env_with(installed_plugin))
    assert "hello" in strategies.stdout and "says hello" in strategies.stdout


def test_external_plugin_hooks_run_in_workers(installed_plugin, tmp_path, tiny_script):
    marker = tmp_path / "marker.txt"
    result = run_cli("run", "--strategy", "hello", "--hello-greeting", "bonjour",
                     "--max-steps", "2", "--run-dir", str(tmp_path / "r"), tiny_script,
                     cwd=tmp_path, env=env_with(installed_plugin, HELLO_MARKER=str(marker)))
    assert result.returncode == 0, result
    assert marker.read_text() == "hello:bonjour"


def test_dash_p_no_blocks_the_plugin(installed_plugin, tmp_path, tiny_script):
    env = env_with(installed_plugin)
    listed = run_cli("-p", "no:hello", "plugins", env=env)
    assert "hello" not in listed.stdout
    result = run_cli("-p", "no:hello", "run", "--strategy", "hello", tiny_script, env=env)
    assert result.returncode == 2
    assert "strategy 'hello' comes from plugin 'hello', which is blocked" in result.stderr
    # Blocked in workers too: the marker hook never runs there.
    marker = tmp_path / "m.txt"
    ok = run_cli("-p", "no:hello", "run", "--max-steps", "1", "--run-dir",
                 str(tmp_path / "r"), tiny_script, cwd=tmp_path,
                 env=env_with(installed_plugin, HELLO_MARKER=str(marker)))
    assert ok.returncode == 0, ok
    assert not marker.exists()


def test_autoload_can_be_turned_off(installed_plugin):
    result = run_cli("plugins", env=env_with(installed_plugin,
                                             DISTRUN_DISABLE_PLUGIN_AUTOLOAD="1"))
    assert "hello" not in result.stdout
    assert "core" in result.stdout


def test_misspelled_hook_is_an_error_naming_the_plugin(cli, tmp_path, monkeypatch):
    (tmp_path / "typo_plugin.py").write_text(
        "from distrun import hookimpl\n\n@hookimpl\ndef distrun_on_fit_strat(run):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        result = cli("plugins", env={"DISTRUN_PLUGINS": "typo_plugin"})
    finally:
        sys.modules.pop("typo_plugin", None)  # in-process: leave no module behind
    assert result.returncode == 2, result
    assert "plugin 'typo_plugin' implements a hook distrun does not have" in result.stderr
    assert "distrun_on_fit_strat" in result.stderr


def test_fresh_manager_fixture(distrun_pm):
    from distrun._registry.manager import BUILTIN_PLUGINS

    names = {name for name, plugin in distrun_pm.list_name_plugin() if plugin is not None}
    assert {"core", "single"} <= names <= set(BUILTIN_PLUGINS)
    assert distrun_pm.list_plugin_distinfo() == []  # no entry point was loaded


class _FitStarts:
    """A plugin object that counts the fits it sees."""

    def __init__(self) -> None:
        self.fits = 0

    @distrun.hookimpl
    def distrun_on_fit_start(self, run):
        self.fits += 1


def test_a_trainers_plugins_stay_with_that_trainer(distrun_pm, tmp_path):
    """No process-global manager: a plugin given to one Trainer is not in the next one's."""
    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_task import TinyTask

    seen = _FitStarts()
    first = distrun.Trainer(plugins=(seen,), max_steps=1, summary=False,
                            run_dir=str(tmp_path / "a")).fit(TinyTask())
    second = distrun.Trainer(max_steps=1, summary=False, run_dir=str(tmp_path / "b")).fit(
        TinyTask())
    assert seen.fits == 1
    assert first.pm is not second.pm and not second.pm.is_registered(seen)
