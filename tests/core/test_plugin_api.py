"""`distrun.plugin` is the whole plugin API: documented exactly, torch-free at import, the only
module of the core a plugin imports, and versioned (a plugin for another API is one line)."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import re

import pytest
import tomllib

import distrun
import distrun.plugin
from distrun.testing import imports_torch, run_cli

ROOT = pathlib.Path(__file__).resolve().parents[2]
CORE = ROOT / "core" / "distrun"
#: what a plugin may import of the core
PUBLIC = re.compile(r"^distrun(\.plugin|\.testing(\..*)?)?$")


def _api_section() -> str:
    text = (ROOT / "docs" / "writing-plugins.md").read_text()
    start = text.index("## The plugin API: `distrun.plugin`")
    return text[start:text.index("\n## ", start + 1)]


def _documented() -> dict[str, bool]:
    """Each name the API section documents in a bullet's head -> whether it is marked torch."""
    out: dict[str, bool] = {}
    for line in _api_section().splitlines():
        if not line.startswith("- `"):
            continue
        for part in line[2:].split("; "):
            head = part.split(": ", 1)[0]
            for name in re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", head):
                out[name] = "*(torch)*" in head
    return out


def test_writing_plugins_documents_exactly_the_plugin_api():
    documented = _documented()
    missing = sorted(set(distrun.plugin.__all__) - set(documented))
    extra = sorted(set(documented) - set(distrun.plugin.__all__))
    assert not missing, f"docs/writing-plugins.md does not document: {missing}"
    assert not extra, f"docs/writing-plugins.md documents names distrun.plugin lacks: {extra}"
    torch_marked = {name for name, marked in documented.items() if marked}
    assert torch_marked == set(distrun.plugin._LAZY), "the *(torch)* marks are off"


def test_every_name_resolves_once_and_callables_say_what_they_are():
    assert len(distrun.plugin.__all__) == len(set(distrun.plugin.__all__))
    for name in distrun.plugin.__all__:
        value = getattr(distrun.plugin, name)
        if inspect.isclass(value) or inspect.isfunction(value):
            assert (value.__doc__ or "").strip(), f"distrun.plugin.{name} has no docstring"
    assert dir(distrun.plugin) == sorted(distrun.plugin.__all__)
    with pytest.raises(AttributeError, match="no attribute 'launch_local'"):
        distrun.plugin.launch_local  # noqa: B018 - the lookup is the test


def test_importing_the_plugin_api_does_not_import_torch():
    assert not imports_torch("distrun.plugin")


def test_top_level_keeps_users_names_and_forwards_moved_ones_with_a_warning():
    assert not {"Option", "StashKey", "StrategyInfo", "BackendInfo", "plugin_options",
                "hookspec", "Stash"} & set(distrun.__all__)
    with pytest.warns(DeprecationWarning, match="distrun.plugin.StashKey"):
        assert distrun.StashKey is distrun.plugin.StashKey


def _plugin_sources() -> list[pathlib.Path]:
    """Every module of the plugins here, and the tests' plugins that stand for third-party
    ones."""
    files = [*ROOT.glob("plugins/*/distrun_*/**/*.py"),
             *ROOT.glob("plugins_contrib/*/distrun_*/**/*.py"),
             *(ROOT / "tests" / "core").glob("*_plugin.py"),
             *(ROOT / "tests" / "core" / "thirdparty_plugin").rglob("*.py"),
             ROOT / "tests" / "core" / "allreduce_strategy.py"]
    assert len(files) > 100
    return files


def _core_imports(tree: ast.AST) -> list[str]:
    """Every ``distrun...`` module a file imports, in function bodies and under
    ``TYPE_CHECKING`` too (moving a private module must break no annotation either)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out.extend(alias.name for alias in node.names)
    return [m for m in out if m == "distrun" or m.startswith("distrun.")]


def test_plugins_import_nothing_of_the_core_but_the_public_api():
    private = {}
    for path in _plugin_sources():
        bad = [m for m in _core_imports(ast.parse(path.read_text())) if not PUBLIC.match(m)]
        if bad:
            private[str(path.relative_to(ROOT))] = bad
    assert not private, f"plugins import private core modules: {private}"


def test_the_scaffold_writes_a_plugin_of_the_public_api_only():
    template = CORE / "_cli" / "plugin_template"
    for path in template.glob("*.tmpl"):
        modules = re.findall(r"^\s*(?:from|import) (distrun[\w.]*)", path.read_text(), re.M)
        assert all(PUBLIC.match(m) for m in modules), (path.name, modules)
    assert "DISTRUN_PLUGIN_API = 1" in (template / "plugin.py.tmpl").read_text()


def test_every_private_core_package_is_forbidden_to_plugins_by_the_lint_contract():
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    forbidden = next(c for c in contracts["contracts"]
                     if c["name"].startswith("plugins import only the public API"))
    private = {f"distrun.{p.stem if p.is_file() else p.name}" for p in CORE.iterdir()
               if (p.is_dir() and (p / "__init__.py").exists())
               or (p.suffix == ".py" and p.stem not in ("__init__", "__main__"))}
    assert set(forbidden["forbidden_modules"]) == private - {"distrun.plugin", "distrun.testing"}
    plugins = {p.parent.name for p in ROOT.glob("plugins*/*/distrun_*/__init__.py")}
    assert set(forbidden["source_modules"]) == plugins


def test_every_entry_point_plugin_states_the_api_it_targets():
    for toml in [*ROOT.glob("plugins/*/pyproject.toml"), *ROOT.glob("plugins_contrib/*/pyproject.toml")]:
        points = tomllib.loads(toml.read_text())["project"].get("entry-points", {})
        for target in points.get("distrun", {}).values():
            module = importlib.import_module(target)
            assert module.DISTRUN_PLUGIN_API == distrun.plugin.API_VERSION, target


NEWER = '''
from distrun.plugin import hookimpl

DISTRUN_PLUGIN_API = 99


@hookimpl
def distrun_from_the_future(run):
    pass
'''


def test_a_plugin_for_another_api_is_refused_in_one_line(tmp_path):
    (tmp_path / "future_plugin.py").write_text(NEWER)
    result = run_cli("plugins", cwd=tmp_path,
                     env={"DISTRUN_PLUGINS": "future_plugin", "PYTHONPATH": str(tmp_path)})
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result
    assert f"plugin 'future_plugin' is written for distrun plugin API 99, but distrun " \
           f"{distrun.__version__} provides plugin API {distrun.plugin.API_VERSION}" in lines[0]
    assert "-p no:future_plugin" in lines[0], result
    assert "Traceback" not in result.output, result


#: names of the API that fewer than two plugins of this repository use, kept for third-party
#: plugins (a SLURM-array or Kubernetes launcher, a strategy or backend of its own): each
#: with the test of its own that shows the use it is kept for (``path::function``)
THIRD_PARTY = {
    "API_VERSION": "tests/core/test_plugin_api.py::test_a_plugin_for_another_api_is_refused_in_one_line",
    "hookspec": "tests/core/test_plugin_kit.py::test_a_plugin_adds_hooks_of_its_own_with_hookspec",
    "Strategy": "tests/core/test_plugin_kit.py::test_a_strategy_of_its_own_satisfies_the_protocol",
    "SetupView": "tests/core/test_plugin_kit.py::test_the_run_offers_a_strategy_its_setup_view",
    "BackendInfo": "tests/core/test_backends.py::"
                   "test_a_plain_script_gets_the_plugin_backend_without_naming_it",
    "seed_everything": "tests/core/test_plugin_kit.py::test_seed_everything_repeats_every_rngs_draws",
    "epoch_permutation": "tests/core/test_data.py::test_order_depends_on_seed_and_epoch_only",
    "NodeService": "tests/core/test_worker_group.py::"
                   "test_a_node_service_sees_the_local_launchers_ranks_start_and_end",
    "Relay": "tests/core/test_plugin_kit.py::test_a_relay_prints_remote_ranks_and_names_the_failed_one",
    "ClusterEnv": "tests/core/test_plugin_kit.py::test_a_detected_cluster_runs_its_rank_in_place",
    "resolve_run_config": "tests/core/test_plugin_kit.py::"
                          "test_resolve_run_config_resolves_as_distrun_run_does",
    "join_launcher": "tests/core/test_plugin_kit.py::test_a_rank_that_joined_its_launcher_dies_with_it",
    "die_with_parent": "tests/core/test_reaper.py::"
                       "test_die_with_parent_ends_the_child_but_not_what_it_left",
}


def _plugin_users() -> dict[str, set[str]]:
    """Each name imported from ``distrun.plugin`` -> the plugin packages that import it."""
    users: dict[str, set[str]] = {}
    for path in [*ROOT.glob("plugins/*/distrun_*/**/*.py"),
                 *ROOT.glob("plugins_contrib/*/distrun_*/**/*.py")]:
        package = path.relative_to(ROOT).parts[2]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "distrun.plugin":
                for alias in node.names:
                    users.setdefault(alias.name, set()).add(package)
    return users


def _test_exists(where: str) -> bool:
    path, _, function = where.partition("::")
    file = ROOT / path
    return file.exists() and any(
        isinstance(node, ast.FunctionDef) and node.name == function
        for node in ast.parse(file.read_text()).body)


def test_every_name_of_the_api_is_used_by_two_plugins_or_kept_for_third_parties():
    assert len(distrun.plugin.__all__) <= 45, "the plugin API is designed, not accumulated"
    users = _plugin_users()
    lonely = {name: sorted(users.get(name, ())) for name in distrun.plugin.__all__
              if len(users.get(name, ())) < 2 and name not in THIRD_PARTY}
    assert not lonely, f"used by fewer than two plugins and not kept for third parties: {lonely}"
    assert set(THIRD_PARTY) <= set(distrun.plugin.__all__), "THIRD_PARTY names a removed name"
    shared = sorted(n for n in THIRD_PARTY if len(users.get(n, ())) >= 2)
    assert not shared, f"used by two plugins now: drop them from THIRD_PARTY: {shared}"
    missing = {name: where for name, where in THIRD_PARTY.items() if not _test_exists(where)}
    assert not missing, f"a name kept for third parties without its test: {missing}"
