"""The plugin API: the one module of distrun a plugin imports (beside ``distrun`` and
``distrun.testing``).

Everything a plugin needs of the core is named here, in three sections (the order of
:data:`__all__` and of ``docs/writing-plugins.md``, which documents each name; a test keeps
the page and :data:`__all__` equal):

1. hooks, options and the run: what every plugin uses;
2. the strategy kit: what a strategy, a backend or a mesh-building plugin needs;
3. the launcher kit: what a launcher needs to start the ranks of a node (the worker group
   every distrun launcher runs its ranks in) and to tell its processes apart.

The list is designed, not accumulated: at most 45 names, each used by two plugins of this
repository or kept for third-party plugins with a test of its own (``THIRD_PARTY`` in
``tests/core/test_plugin_api.py``). What a single plugin needs is a method or an option of a
name already here (``config.to_toml()``, ``config.with_values()``, ``WorkerGroup.spares()``,
``WorkerGroup(relay=sink)``, ``Relay.report()``, ``run_key(shared=...)``), so a SLURM-array or
Kubernetes launcher reads one short list, as pytest's plugins use ``pytest`` and never
``_pytest``.

Every other module of the core is private and may move between releases. A plugin states
the API it was written for with ``DISTRUN_PLUGIN_API = 1`` in its entry-point module; a
plugin written for another :data:`API_VERSION` is refused with one line when it loads.

Importing this module does not import torch: the names that need torch (marked "torch" in
the docs) load on first use, so an entry-point module may import them at its top only when
it keeps torch out of ``distrun --help`` some other way (most import them in the module
that holds their strategy).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from distrun._config.parallel_dims import ParallelDims
from distrun._config.run_config import RunConfig
from distrun._config.run_dir import fresh_run_folder
from distrun._launch.binding import LOOPBACK, bind_address, listen_socket, local_address
from distrun._launch.exits import exit_code
from distrun._launch.folder_lock import run_key
from distrun._launch.group import WorkerGroup
from distrun._launch.lifeline import ProcessId, die_with_parent
from distrun._launch.local import resolve_nproc
from distrun._launch.ports import free_port
from distrun._launch.ranks import NodeRanks
from distrun._launch.reaper import reaped
from distrun._launch.relay import Relay
from distrun._loggers.plot import plot_run
from distrun._registry.collect import resolve_run_config
from distrun._spec import keys
from distrun._spec.backends import BackendInfo
from distrun._spec.cluster import ClusterEnv
from distrun._spec.errors import EXIT_REQUEUE, DistrunError, UsageError, first_line
from distrun._spec.markers import API_VERSION, hookimpl, hookspec
from distrun._spec.node import NodeService
from distrun._spec.options import PluginOptions, option
from distrun._spec.stash import StashKey
from distrun._spec.strategy import SetupView, Strategy, StrategyInfo

if TYPE_CHECKING:
    from distrun._strategies.base import BaseStrategy
    from distrun._strategies.mesh import build_mesh
    from distrun._strategies.process_group import join_process_group
    from distrun._train.rng import seed_everything
    from distrun._train.run import Run
    from distrun._train.sampler import epoch_permutation
    from distrun._train.tensors import to_cpu
    from distrun._worker.store import join_launcher, serve_store

__all__ = [
    # 1. hooks, options and the run
    "API_VERSION", "hookimpl", "hookspec",
    "PluginOptions", "option", "RunConfig",
    "Run", "StashKey", "keys",
    "DistrunError", "UsageError", "first_line", "EXIT_REQUEUE",
    "plot_run",
    # 2. the strategy kit
    "Strategy", "BaseStrategy", "StrategyInfo", "SetupView", "BackendInfo",
    "ParallelDims", "build_mesh", "join_process_group",
    "seed_everything", "to_cpu", "epoch_permutation",
    # 3. the launcher kit: the worker group ...
    "WorkerGroup", "NodeRanks", "NodeService", "Relay", "exit_code", "ClusterEnv",
    "resolve_nproc", "resolve_run_config", "fresh_run_folder",
    # ... where the run listens ...
    "LOOPBACK", "bind_address", "local_address", "listen_socket", "free_port", "serve_store",
    # ... and which processes are whose
    "run_key", "ProcessId", "join_launcher", "die_with_parent", "reaped",
]

#: names whose modules import torch, loaded on first use
_LAZY = {
    "BaseStrategy": "distrun._strategies.base",
    "build_mesh": "distrun._strategies.mesh",
    "join_process_group": "distrun._strategies.process_group",
    "seed_everything": "distrun._train.rng",
    "Run": "distrun._train.run",
    "to_cpu": "distrun._train.tensors",
    "epoch_permutation": "distrun._train.sampler",
    "join_launcher": "distrun._worker.store",
    "serve_store": "distrun._worker.store",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'distrun.plugin' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
