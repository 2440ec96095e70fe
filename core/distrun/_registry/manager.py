"""The plugin manager: built-in plugins and entry points of group ``distrun``, one path for both.

- ``DISTRUN_DISABLE_PLUGIN_AUTOLOAD=1`` skips entry points (tests use it for a clean manager);
- ``DISTRUN_PLUGINS=mod1,mod2`` registers importable modules as plugins as well;
- ``-p no:NAME`` on the CLI (or ``DISTRUN_BLOCK_PLUGINS=NAME,...``) blocks a plugin by name.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pluggy

from distrun._spec import hookspecs
from distrun._spec.errors import UsageError
from distrun._spec.markers import API_ATTRIBUTE, API_VERSION, ENTRY_POINT_GROUP, PROJECT

__all__ = [
    "PluginInfo",
    "blocked_implementers",
    "check_api_versions",
    "known_plugin_names",
    "make_plugin_manager",
    "manager_of",
    "plugin_infos",
]

#: modules of the core registered on every manager, by plugin name
BUILTIN_PLUGINS = {
    "core": "distrun._train.builtin",
    "launch": "distrun._launch.builtin",
    "single": "distrun._strategies.single",
    "backends": "distrun._strategies.backends",
    "console": "distrun._loggers.console",
    "csv_logger": "distrun._loggers.csv_file",
    "runfolder": "distrun._launch.run_folder",
    "plot": "distrun._cli.plot_cmd",
    "stacks": "distrun._cli.stacks_cmd",
    "config": "distrun._cli.config_cmd",
    "scaffold": "distrun._cli.plugin_new",
}
AUTOLOAD_ENV = "DISTRUN_DISABLE_PLUGIN_AUTOLOAD"
EXTRA_ENV = "DISTRUN_PLUGINS"
BLOCK_ENV = "DISTRUN_BLOCK_PLUGINS"

def _split(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def make_plugin_manager(
    blocked: Iterable[str] = (),
    extra: Iterable[str] = (),
    autoload: bool | None = None,
) -> pluggy.PluginManager:
    """Build a fresh manager: specs, built-ins, entry points, extra modules; then validate."""
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(hookspecs)
    blocked = set(blocked) | set(_split(os.environ.get(BLOCK_ENV)))
    for name in blocked:
        pm.set_blocked(name)
    for name, module in BUILTIN_PLUGINS.items():
        if not pm.is_blocked(name):
            pm.register(importlib.import_module(module), name=name)
    if autoload is None:
        autoload = os.environ.get(AUTOLOAD_ENV, "") in ("", "0")
    if autoload:
        try:
            pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
        except pluggy.PluginValidationError as exc:
            raise UsageError(f"plugin {exc.plugin!r} is broken: {exc}") from None
        except ImportError as exc:
            raise UsageError(
                f"a distrun plugin failed to import: {exc} (reinstall it, or block it with "
                "-p no:NAME)"
            ) from None
    for module in [*_split(os.environ.get(EXTRA_ENV)), *extra]:
        name = module.rsplit(".", 1)[-1]
        if pm.is_blocked(name) or pm.is_blocked(module) or pm.has_plugin(module):
            continue
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            raise UsageError(f"cannot import plugin module {module!r}: {exc}") from None
        pm.register(mod, name=module)
    check_api_versions(pm)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise UsageError(
            f"plugin {pm.get_name(exc.plugin)!r} implements a hook distrun does not have: {exc} "
            "(check the hook's spelling against distrun's docs/hooks.md)"
        ) from None
    return pm


def check_api_versions(pm: pluggy.PluginManager) -> None:
    """Refuse a plugin written for another plugin API than this distrun's, in one line.

    A plugin states its API as ``DISTRUN_PLUGIN_API = N`` in the module it registers; one that
    states none was written before the API had a version and is taken as version 1. Checked
    before ``check_pending``, so a plugin for a newer API is told as that, not as a hook typo.
    """
    from distrun._version import __version__

    dists = {id(plugin): dist for plugin, dist in pm.list_plugin_distinfo()}
    for name, plugin in pm.list_name_plugin():
        wanted = getattr(plugin, API_ATTRIBUTE, API_VERSION) if plugin is not None else None
        if wanted is None or wanted == API_VERSION:
            continue
        dist = dists.get(id(plugin))
        where = f" ({dist.project_name} {dist.version})" if dist is not None else ""
        fix = (f"install a {dist.project_name} release for API {API_VERSION}"
               if dist is not None else f"update it to API {API_VERSION}")
        raise UsageError(
            f"plugin {name!r}{where} is written for distrun plugin API {wanted!r}, but distrun "
            f"{__version__} provides plugin API {API_VERSION} ({fix}, or block it with "
            f"-p no:{name})")


def manager_of(config: Any) -> pluggy.PluginManager:
    """The manager ``config`` travels with (``config.pluginmanager``), or, for a config built
    without one (a bare ``RunConfig()``), a fresh one from the environment's settings."""
    pm = getattr(config, "pluginmanager", None)
    return pm if pm is not None else make_plugin_manager()


@dataclass(frozen=True)
class PluginInfo:
    name: str
    version: str
    distribution: str
    hooks: tuple[str, ...]
    builtin: bool


def plugin_infos(pm: pluggy.PluginManager) -> list[PluginInfo]:
    """Registered plugins with their distribution, version and implemented hooks."""
    from distrun._version import __version__

    dists = {id(plugin): dist for plugin, dist in pm.list_plugin_distinfo()}
    out = []
    for name, plugin in pm.list_name_plugin():
        if plugin is None:
            continue
        dist = dists.get(id(plugin))
        hooks = tuple(sorted(caller.name for caller in pm.get_hookcallers(plugin) or ()))
        if dist is not None:
            out.append(PluginInfo(name, dist.version, dist.project_name, hooks, False))
        else:
            builtin = name in BUILTIN_PLUGINS
            out.append(PluginInfo(name, __version__ if builtin else "",
                                  "distrun" if builtin else name, hooks, builtin))
    return out


def _entry_points() -> dict[str, Any]:
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def known_plugin_names(pm: pluggy.PluginManager) -> set[str]:
    """Every name ``-p no:NAME`` can block: built-ins, installed entry points, registered."""
    names = {name for name, plugin in pm.list_name_plugin() if plugin is not None}
    return names | set(BUILTIN_PLUGINS) | set(_entry_points())


def blocked_implementers(pm: pluggy.PluginManager, hook: str) -> list[str]:
    """The blocked plugins (``-p no:NAME``) that implement ``hook``, by name.

    A blocked plugin is not registered, so its module is imported here to look (plugin
    modules are import-light by the house rules); one that fails to import is left out.
    Called on an error path only.
    """
    eps = _entry_points()
    out = []
    for name, plugin in pm.list_name_plugin():
        if plugin is not None:
            continue  # registered, not blocked
        try:
            if name in BUILTIN_PLUGINS:
                module: Any = importlib.import_module(BUILTIN_PLUGINS[name])
            elif name in eps:
                module = eps[name].load()
            else:
                module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a broken blocked plugin is not a candidate
            continue
        if callable(getattr(module, hook, None)):
            out.append(name)
    return sorted(out)
