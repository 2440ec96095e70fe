"""Collect what plugins declare (options, strategies) and choose a strategy. Torch-free."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, cast

import pluggy

from distrun._config.run_config import RunConfig, core_options, resolve_config, resume_words
from distrun._registry.catalogue import offered
from distrun._spec.backends import BackendInfo, parse_backend
from distrun._spec.cluster import ClusterEnv
from distrun._spec.errors import UsageError, closest, suggest
from distrun._spec.options import Option, PluginOptions
from distrun._spec.strategy import StrategyInfo

__all__ = ["apply_cluster_env", "check_consumed", "detect_cluster",
           "choose_backends", "choose_strategy", "collect_backends", "collect_options",
           "collect_strategies", "option_registrar", "resolve_run_config"]



#: per manager: the plugins it had and the options they declared (asked once per plugin set)
_OPTIONS: weakref.WeakKeyDictionary[pluggy.PluginManager, tuple[frozenset[int], list[Option]]] \
    = weakref.WeakKeyDictionary()


def _registrar(out: dict[str, Any], what: str, verb: str) -> Callable[[Any], None]:
    """The ``register`` callback of a registration hook: a name given twice is a plugin bug."""

    def register(item: Any) -> None:
        if item.name in out:
            raise UsageError(f"{what} {item.name!r} is {verb} twice "
                             f"({out[item.name].plugin} and {item.plugin})")
        out[item.name] = item

    return register


def option_registrar(out: dict[str, Option]) -> Callable[[Any], None]:
    """``distrun_register_options``' ``register``: takes an :class:`Option` or a
    :class:`PluginOptions` class (each of its fields)."""
    register = _registrar(out, "option", "declared")

    def register_options(item: Option | type[PluginOptions]) -> None:
        if isinstance(item, type) and issubclass(item, PluginOptions):
            for opt in item.declarations():
                register(opt)
        else:
            register(item)

    return register_options


def collect_options(pm: pluggy.PluginManager) -> list[Option]:
    """Core options and every plugin's; a name declared twice is a plugin bug.

    ``distrun_register_options`` is called once per set of registered plugins: a launcher or
    worker that needs the declarations again (the run folder's ``config.toml``) gets the same.
    """
    plugins = frozenset(id(p) for p in pm.get_plugins())
    cached = _OPTIONS.get(pm)
    if cached is not None and cached[0] == plugins:
        return list(cached[1])
    out: dict[str, Option] = {o.name: o for o in core_options()}
    words = resume_words(pm)
    if words:  # --help names the words the installed plugins add
        added = "; ".join(f"'{w}': {meaning}" for w, meaning in words.items())
        out["resume"] = replace(out["resume"], help=f"{out['resume'].help} ({added})")
    pm.hook.distrun_register_options(register=option_registrar(out))
    _OPTIONS[pm] = (plugins, list(out.values()))
    return list(out.values())


def collect_strategies(pm: pluggy.PluginManager) -> dict[str, StrategyInfo]:
    out: dict[str, StrategyInfo] = {}
    pm.hook.distrun_register_strategies(register=_registrar(out, "strategy", "offered"))
    return out


def collect_backends(pm: pluggy.PluginManager) -> dict[str, BackendInfo]:
    out: dict[str, BackendInfo] = {}
    pm.hook.distrun_register_backends(register=_registrar(out, "backend", "offered"))
    return out


def choose_backends(config: RunConfig, backends: dict[str, BackendInfo],
                    nnodes: int | None = None) -> dict[str, BackendInfo]:
    """The backends ``--backend`` names, by device type (``"*"``: every device); torch-free.

    Says in one line a name nobody offers (with the installed ones and what to install), a
    device the backend does not serve, and a single-node backend asked for on several nodes.
    Whether it can run on this machine is for the worker to check (``BackendInfo.unavailable``).
    """
    out: dict[str, BackendInfo] = {}
    for device, name in parse_backend(config.backend).items():
        info = backends.get(name)
        if info is None:
            installed = ", ".join(sorted(backends))
            catalogue = offered("backends")
            known = [*backends, *catalogue]
            hint = "" if name in catalogue else suggest(name, known)
            wanted = name if name in catalogue else closest(name, known)
            install = (f" Install it with: pip install {catalogue[wanted]}"
                       if wanted in catalogue else "")
            hint = hint or "."
            raise UsageError(f"unknown backend '{name}'{hint} Installed: {installed}.{install}")
        if device != "*" and device not in info.devices:
            raise UsageError(f"backend '{name}' serves {', '.join(info.devices)}, not {device} "
                             f"(--backend {device}:NAME names the {device} backend)")
        if info.single_node and nnodes is not None and nnodes > 1:
            others = sorted(n for n, i in backends.items()
                            if not i.single_node and set(i.devices) & set(info.devices))
            raise UsageError(f"backend '{name}' reaches the ranks of one machine only, but "
                             f"--nnodes is {nnodes} (use --backend "
                             f"{others[0] if others else 'gloo'} for several nodes)")
        out[device] = info
    return out


def choose_strategy(config: RunConfig, world_size: int | None,
                    strategies: dict[str, StrategyInfo],
                    is_blocked: Callable[[str], bool] | None = None) -> StrategyInfo:
    """The strategy the config names; ``auto`` means single for one process, else the
    multi-process strategy with the highest ``StrategyInfo.auto_priority`` (ties: by name).

    ``is_blocked`` tells plugin names ``-p no:NAME`` blocked (``pm.is_blocked``): asking for a
    strategy such a plugin offers is told as that, not as an unknown name.
    """
    name = config.strategy
    if name == "auto":
        if world_size is None or world_size > 1:
            ranked = sorted((s for s in strategies.values()
                             if s.multi_process and s.auto_priority > 0),
                            key=lambda s: (-s.auto_priority, s.name))
            if ranked:
                return ranked[0]
            if world_size is None:
                return strategies["single"]
            offers = sorted(set(offered("strategies").values()))
            raise UsageError(
                f"{world_size} processes need a data-parallel strategy and none is installed "
                "that --strategy auto may pick (name one with --strategy NAME, or install one: "
                f"pip install {' | '.join(offers) or 'a strategy plugin'})"
            )
        return strategies["single"]
    if name in strategies:
        return strategies[name]
    catalogue = offered("strategies")
    owners = [name] + ([catalogue[name].removeprefix("distrun-")] if name in catalogue else [])
    blocked = [p for p in owners if is_blocked is not None and is_blocked(p)]
    if blocked:
        plugin = blocked[0]
        raise UsageError(f"strategy '{name}' comes from plugin '{plugin}', which is blocked "
                         f"(-p no:{plugin} or DISTRUN_BLOCK_PLUGINS); unblock it to use "
                         f"--strategy {name}")
    installed = ", ".join(sorted(strategies))
    hint = suggest(name, [*strategies, *catalogue])
    wanted = name if name in catalogue else closest(name, [*strategies, *catalogue])
    install = (f" Install it with: pip install {catalogue[wanted]}"
               if wanted in catalogue and wanted not in strategies else "")
    raise UsageError(f"unknown strategy '{name}'{hint} Installed: {installed}.{install}")


def detect_cluster(pm: pluggy.PluginManager, environ: Mapping[str, str]) -> ClusterEnv | None:
    """Where this launcher sits (``distrun_detect_cluster``); a launch asks once and hands the
    answer on (to ``distrun_launch`` as ``cluster``)."""
    return cast("ClusterEnv | None", pm.hook.distrun_detect_cluster(environ=dict(environ)))


def apply_cluster_env(config: RunConfig, cluster: ClusterEnv | None) -> RunConfig:
    """Fill the layout fields the user left unset from the detected cluster environment."""
    from distrun._config.run_config import with_values

    if cluster is None:
        return config
    fill = {}
    for key in ("nnodes", "node_rank", "master_addr", "master_port", "nproc_per_node"):
        value = getattr(cluster, key)
        if value is not None and key not in config.sources:
            fill[key] = str(value) if key == "nnodes" else value
    return with_values(config, source=f"cluster:{cluster.name}", **fill) if fill else config


def check_consumed(pm: pluggy.PluginManager, options: list[Option], config: RunConfig) -> None:
    """An option the user set that no plugin reads is an error, not a no-op.

    For each option that names its ``consumer`` hook: when its value is not the default, came
    from the user (not from the launcher, the cluster or a plugin, whose source is the
    plugin's name) and no registered plugin implements the hook, say so in one line, naming
    the blocked plugins that would read it.
    """
    from distrun._registry.manager import blocked_implementers

    for opt in options:
        if not opt.consumer:
            continue
        source = config.sources.get(opt.name)
        value = config.get(opt.name, opt.default)
        if source is None or value == opt.default or source == "launcher" or \
                source.startswith("cluster:") or pm.get_plugin(source) is not None:
            continue
        if getattr(pm.hook, opt.consumer).get_hookimpls():
            continue
        blocked = blocked_implementers(pm, opt.consumer)
        if blocked:
            names = ", ".join(f"'{n}'" for n in blocked)
            verb = "is" if len(blocked) == 1 else "are"
            flags = " ".join(f"-p no:{n}" for n in blocked)
            raise UsageError(
                f"{opt.flag} {value}: no plugin reads it: {names}, which implement"
                f"{'s' if len(blocked) == 1 else ''} {opt.consumer}, {verb} blocked ({flags} "
                f"or DISTRUN_BLOCK_PLUGINS); unblock it, or drop {opt.flag}")
        raise UsageError(
            f"{opt.flag} {value}: no plugin reads it: no installed plugin implements "
            f"{opt.consumer} (install one that does: `distrun plugins` lists the installed "
            f"ones and their hooks), or drop {opt.flag}")


def resolve_run_config(code: dict[str, Any], world_size: int) -> RunConfig:
    """The run config of ``world_size`` processes from flags' sources and ``code`` values,
    checked and with its strategy chosen, as ``distrun run`` resolves it before any worker
    starts (for launchers that start workers from code: a notebook's cell)."""
    from distrun._registry.manager import make_plugin_manager

    pm = make_plugin_manager()
    config = resolve_config(collect_options(pm), code=code, pluginmanager=pm)
    choose_strategy(config, world_size, collect_strategies(pm), pm.is_blocked)
    return config
