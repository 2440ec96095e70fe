"""``distrun plugin new NAME``: write a working plugin folder to start from.

The files come from ``plugin_template/*.tmpl`` (``@NAME@`` and the like filled in). The folder
holds a pyproject with the ``distrun`` entry point, a torch-free ``plugin.py`` with
an option and three hook implementations, a test that runs ``distrun`` through
``distrun.testing``, a README and a tox env. ``pip install -e NAME`` and it shows up in
``distrun plugins``.
"""

from __future__ import annotations

import json
import os
import re
from importlib import resources

import click

from distrun._spec.errors import UsageError
from distrun._spec.markers import hookimpl

__all__ = ["plugin_files", "write_plugin"]

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def _template(name: str) -> str:
    """The text of ``plugin_template/NAME.tmpl`` (package data, read as files are installed)."""
    return (resources.files("distrun._cli") / "plugin_template" / f"{name}.tmpl").read_text()


def plugin_files(name: str, summary: str = "") -> dict[str, str]:
    """The scaffold's files (relative path -> text) for plugin ``name``."""
    if not _NAME.match(name):
        raise UsageError(f"invalid plugin name {name!r} (use lower case letters, digits and "
                         "underscores, starting with a letter, e.g. my_logger)")
    if re.search(r"[\x00-\x1f\x7f-\x9f]", summary):
        raise UsageError(f"--summary {summary!r} holds a control character (a newline, tab or "
                         "escape); give one line in printable characters")
    summary = (summary or f"the {name} plugin for distrun").rstrip(".")
    subs = {"@NAME@": name, "@DIST@": name.replace("_", "-"), "@FLAG@": name.replace("_", "-"),
            "@UPPER@": name.upper(),
            "@CLASS@": "".join(part.capitalize() for part in name.split("_"))}
    # the summary lands in a TOML string, Python docstrings and Markdown: quoted for each
    in_toml = json.dumps(summary)[1:-1]  # JSON escapes are valid TOML basic-string escapes
    in_python = summary.replace("\\", "\\\\").replace('"', '\\"')

    def fill(text: str, summary: str = in_python) -> str:
        for key, value in {**subs, "@SUMMARY@": summary}.items():
            text = text.replace(key, value)
        return text

    pkg = f"distrun_{name}"
    return {
        "pyproject.toml": fill(_template("pyproject.toml"), in_toml),
        f"{pkg}/__init__.py": fill(_template("__init__.py")),
        f"{pkg}/plugin.py": fill(_template("plugin.py")),
        f"{pkg}/py.typed": "",
        f"tests/test_{name}.py": fill(_template("test_plugin.py")),
        "README.md": fill(_template("README.md"), summary),
        "tox.ini": _template("tox.ini"),
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
