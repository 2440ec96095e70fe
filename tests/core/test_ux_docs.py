"""The docs stay true: the hook reference is generated from the current hookspecs, every
hookspec is documented there, every plugin folder is in the directory, links resolve."""

from __future__ import annotations

import importlib.util
import inspect
import re
from pathlib import Path

import pytest

from distrun._spec import hookspecs

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SPECS = sorted(n for n, f in vars(hookspecs).items() if n.startswith("distrun_") and callable(f))


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_hooks", DOCS / "gen_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hook_reference_is_current():
    text = load_generator().generate()
    assert (DOCS / "hooks.md").read_text() == text, (
        "docs/hooks.md is stale: run `python docs/gen_hooks.py`")


def test_every_hookspec_is_in_the_reference_with_its_docstring():
    text = (DOCS / "hooks.md").read_text()
    headings = re.findall(r"^### `(distrun_\w+)`$", text, re.M)
    assert sorted(headings) == SPECS
    for name in SPECS:
        summary = inspect.getdoc(getattr(hookspecs, name)).splitlines()[0]
        section = text.split(f"### `{name}`", 1)[1].split("\n### ", 1)[0]
        assert summary.replace("``", "`").split(":class:")[0][:40] in section, name
        assert "UNDOCUMENTED" not in section


def test_generator_marks_firstresult_and_historic_hooks():
    text = (DOCS / "hooks.md").read_text()
    for name in SPECS:
        opts = getattr(getattr(hookspecs, name), "distrun_spec", {}) or {}
        section = text.split(f"### `{name}`", 1)[1].split("\n### ", 1)[0]
        assert ("*firstresult" in section) == bool(opts.get("firstresult")), name
        assert ("historic:" in section) == bool(opts.get("historic")), name


def plugin_folders() -> list[str]:
    out = []
    for parent in ("plugins", "plugins_contrib"):
        out += [f"{parent}/{p.name}" for p in sorted((ROOT / parent).iterdir())
                if (p / "pyproject.toml").exists()]
    return out


@pytest.mark.parametrize("folder", plugin_folders())
def test_plugin_directory_lists_every_plugin(folder):
    assert f"]({'../' + folder}" in (DOCS / "plugins.md").read_text(), (
        f"docs/plugins.md has no entry linking to {folder}")


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_relative_links_resolve(page):
    text = (DOCS / page).read_text()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        assert (DOCS / target).resolve().exists(), f"{page} links to missing {target}"
