"""The core's catalogue of first-party plugins is data the plugins declare: each entry equals
the ``[tool.distrun.offers]`` of that plugin's pyproject.toml, and that equals what the plugin
registers (strategies, backends, flags). So the install hint of a name stays true when a plugin
renames or adds one, and the core names no plugin in its code."""

from __future__ import annotations

import importlib
import pathlib

import pytest
import tomllib

from distrun._registry.catalogue import offered

ROOT = pathlib.Path(__file__).resolve().parents[2]
CATALOGUE = tomllib.loads((ROOT / "core/distrun/_registry/catalogue.toml").read_text())
PROJECTS = sorted([*ROOT.glob("plugins/*/pyproject.toml"),
                   *ROOT.glob("plugins_contrib/*/pyproject.toml")])


def _registered(module_name: str) -> dict[str, list[str]]:
    module = importlib.import_module(module_name)
    out: dict[str, list[str]] = {"strategies": [], "backends": [], "flags": []}
    for hook, kind, names in (
            ("distrun_register_strategies", "strategies", lambda info: [info.name]),
            ("distrun_register_backends", "backends", lambda info: [info.name]),
            ("distrun_register_options", "flags", lambda opt: [
                flag for o in (opt.declarations() if isinstance(opt, type) else [opt])
                for flag in (o.flag, *o.aliases)])):
        if hasattr(module, hook):
            getattr(module, hook)(register=lambda x, k=kind, n=names: out[k].extend(n(x)))
    return {kind: sorted(set(names)) for kind, names in out.items() if names}


@pytest.mark.parametrize("toml", PROJECTS, ids=lambda p: p.parent.name)
def test_a_plugin_declares_what_it_registers_and_the_catalogue_repeats_it(toml):
    project = tomllib.loads(toml.read_text())
    points = project["project"].get("entry-points", {}).get("distrun", {})
    if not points:
        pytest.skip(f"{project['project']['name']} is a library, not a plugin")
    (module,) = points.values()
    declared = project["tool"]["distrun"]["offers"]
    assert declared == _registered(module), f"{toml}: [tool.distrun.offers] is stale"
    assert CATALOGUE.get(project["project"]["name"]) == declared, \
        f"core/distrun/_registry/catalogue.toml differs from {toml}"


def test_the_catalogue_lists_only_distributions_of_this_repository():
    names = {tomllib.loads(t.read_text())["project"]["name"] for t in PROJECTS}
    assert set(CATALOGUE) <= names
    assert offered("strategies")["fsdp"] == "distrun-fsdp"
    assert offered("flags")["--tp-size"] == "distrun-tp"
    assert offered("backends")["shm"] == "distrun-shm"


def test_a_missing_plugins_flag_names_its_distribution(cli, tmp_path):
    (tmp_path / "s.py").write_text("pass\n")
    result = cli("-p", "no:ddp", "run", "--ddp-static-graph", "s.py", cwd=tmp_path)
    assert result.returncode == 2, result
    assert "(--ddp-static-graph comes with distrun-ddp: pip install distrun-ddp)" \
        in result.stderr, result
