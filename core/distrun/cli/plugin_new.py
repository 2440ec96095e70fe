"""``distrun plugin new NAME``: write a working plugin folder to start from.

The folder holds a pyproject with the ``distrun`` entry point, a torch-free ``plugin.py`` with
an option and three hook implementations, a test that runs ``distrun`` through
``distrun.testing``, a README and a tox env. ``pip install -e NAME`` and it shows up in
``distrun plugins``.
"""

from __future__ import annotations

import os
import re

import click

from distrun.spec.errors import UsageError
from distrun.spec.markers import hookimpl

__all__ = ["plugin_files", "write_plugin"]

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")

_PYPROJECT = '''\
[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "distrun-@DIST@"
version = "0.1.0"
description = "@SUMMARY@"
readme = "README.md"
requires-python = ">=3.10"
dependencies = ["distrun>=0.1"]

[project.optional-dependencies]
test = ["pytest>=8"]

# distrun finds plugins through this entry point group; the key is the plugin's name.
[project.entry-points.distrun]
@NAME@ = "distrun_@NAME@.plugin"

[tool.setuptools.packages.find]
include = ["distrun_@NAME@*"]

[tool.setuptools.package-data]
"distrun_@NAME@" = ["py.typed"]
'''

_INIT = '''\
"""distrun-@DIST@: @SUMMARY@."""

__version__ = "0.1.0"
'''

_PLUGIN = '''\
"""Entry point of distrun-@DIST@: @SUMMARY@.

Keep this module torch-free at import time (`distrun --help` and `distrun plugins`
load it): import torch inside hook bodies, or keep torch code in another module.
The hooks and their contracts: `python -m pydoc distrun.spec.hookspecs`.
"""

from __future__ import annotations

from distrun import Option, StashKey, hookimpl

_STEPS: StashKey[int] = StashKey("@NAME@.steps")  # this plugin's slot in run.stash


@hookimpl
def distrun_register_options(register):
    # Gives --@FLAG@-report/--no-@FLAG@-report, DISTRUN_@UPPER@_REPORT and a TOML key.
    register(Option("@NAME@_report", bool, True, plugin="@NAME@",
                    help="print how many optimizer steps ran, on rank 0 at the end"))


@hookimpl
def distrun_on_fit_start(run):
    run.stash[_STEPS] = 0


@hookimpl
def distrun_on_step_end(run, step, metrics):
    run.stash[_STEPS] += 1  # hot path: keep it cheap


@hookimpl
def distrun_on_fit_end(run):
    if run.is_global_zero and run.config.@NAME@_report:
        print(f"@NAME@: {run.stash[_STEPS]} steps", flush=True)
'''

_TEST = '''\
"""distrun-@DIST@ tested the way a user runs it: `distrun` in a subprocess."""

from __future__ import annotations

from distrun.testing import run_cli

TASK = """
import torch
import distrun


class Task(distrun.Task):
    def configure_model(self):
        return torch.nn.Linear(4, 1)

    def train_data(self):
        x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))

    def training_step(self, model, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)
"""


def test_listed_by_distrun_plugins():
    result = run_cli("plugins")
    assert result.returncode == 0, result
    assert "@NAME@ 0.1.0 (distrun-@DIST@)" in result.stdout, result


def test_reports_the_steps_run(tmp_path):
    (tmp_path / "task.py").write_text(TASK)
    result = run_cli("run", "--max-steps", "3", "--batch-size", "16", "task.py:Task",
                     cwd=tmp_path)
    assert result.returncode == 0, result
    assert "@NAME@: 3 steps" in result.stdout, result


def test_option_turns_the_report_off(tmp_path):
    (tmp_path / "task.py").write_text(TASK)
    result = run_cli("run", "--max-steps", "2", "--batch-size", "16",
                     "--no-@FLAG@-report", "task.py:Task", cwd=tmp_path)
    assert result.returncode == 0, result
    assert "@NAME@:" not in result.stdout, result
'''

_README = '''\
# distrun-@DIST@

@SUMMARY@.

A distrun plugin: it counts the optimizer steps of a run and prints
the count on rank 0 at the end. Replace the hooks in `distrun_@NAME@/plugin.py` with yours.

## Install and try

    pip install -e .            # registers the entry point `@NAME@` in group `distrun`
    distrun plugins             # lists `@NAME@ 0.1.0 (distrun-@DIST@)` and its hooks
    distrun run --help          # shows --@FLAG@-report / --no-@FLAG@-report

## Options

| flag | TOML key | variable | default |
|---|---|---|---|
| `--@FLAG@-report/--no-@FLAG@-report` | `@NAME@_report` | `DISTRUN_@UPPER@_REPORT` | true |

## Test

    pip install -e ".[test]" && pytest      # or: tox

Inside the distrun repository, add this line to the `deps` of `[testenv:contrib-...]` in
tox.ini (and `@NAME@` to its env list):

    contrib-@NAME@: -e plugins_contrib/@NAME@
'''

_TOX = '''\
[tox]
env_list = py

[testenv]
description = the plugin's tests against the installed distrun
deps = pytest>=8
commands = pytest {posargs:tests}
'''


def plugin_files(name: str, summary: str = "") -> dict[str, str]:
    """The scaffold's files (relative path -> text) for plugin ``name``."""
    if not _NAME.match(name):
        raise UsageError(f"invalid plugin name {name!r} (use lower case letters, digits and "
                         "underscores, starting with a letter, e.g. my_logger)")
    summary = summary or f"the {name} plugin for distrun"
    subs = {"@NAME@": name, "@DIST@": name.replace("_", "-"), "@FLAG@": name.replace("_", "-"),
            "@UPPER@": name.upper(), "@SUMMARY@": summary.rstrip(".")}

    def fill(text: str) -> str:
        for key, value in subs.items():
            text = text.replace(key, value)
        return text

    pkg = f"distrun_{name}"
    return {
        "pyproject.toml": fill(_PYPROJECT),
        f"{pkg}/__init__.py": fill(_INIT),
        f"{pkg}/plugin.py": fill(_PLUGIN),
        f"{pkg}/py.typed": "",
        f"tests/test_{name}.py": fill(_TEST),
        "README.md": fill(_README),
        "tox.ini": _TOX,
    }


def write_plugin(name: str, parent: str = ".", summary: str = "") -> str:
    """Write the scaffold of plugin ``name`` into ``parent/name``; return that folder."""
    files = plugin_files(name, summary)
    root = os.path.join(parent, name)
    if os.path.exists(root):
        raise UsageError(f"{root} already exists (pick another name or --dir)")
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            fh.write(text)
    return root


@click.group("plugin")
def plugin_group() -> None:
    """Tools for plugin authors."""


@plugin_group.command("new")
@click.argument("name")
@click.option("--dir", "parent", default=".", show_default=True,
              help="folder to create the plugin folder in")
@click.option("--summary", default="", help="one-line description for pyproject and README")
def new_cmd(name: str, parent: str, summary: str) -> None:
    """Write a working plugin folder NAME/ (pyproject, hooks, test, README, tox env)."""
    root = write_plugin(name, parent, summary)
    click.echo(f"wrote {root}/ (distrun-{name.replace('_', '-')})")
    click.echo(f"next: pip install -e {root} && distrun plugins && pytest {root}/tests")
    click.echo(f"tox env line for the distrun repo: contrib-{name}: -e plugins_contrib/{name}")


@hookimpl
def distrun_add_commands(cli):
    cli.add_command(plugin_group)
