"""The plugin API: the one module of distrun a plugin imports (beside ``distrun`` and
``distrun.testing``).

Everything a plugin needs of the core is named here; every other module of the core is
private and may move between releases. ``docs/writing-plugins.md`` documents each name
(a test keeps the page and :data:`__all__` equal). A plugin states the API it was written
for with ``DISTRUN_PLUGIN_API = 1`` in its entry-point module; a plugin written for
another :data:`API_VERSION` is refused with one line when it loads.

Importing this module does not import torch: the names that need torch (marked "torch" in
the docs) load on first use, so an entry-point module may import them at its top only when
it keeps torch out of ``distrun --help`` some other way (most import them in the module
that holds their strategy).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from distrun.config.parallel_dims import ParallelDims
from distrun.config.run_config import CONFIG_ENV, RunConfig, with_values
from distrun.config.run_dir import fresh_run_folder
from distrun.launch.binding import (
    LOOPBACK,
    STORE_FD_ENV,
    bind_address,
    interface_addresses,
    listen_socket,
    server_env,
)
from distrun.launch.binding import resolve as resolve_host
from distrun.launch.exits import ExitWatch, exit_code
from distrun.launch.folder_lock import RUN_KEY_ENV, new_run_key
from distrun.launch.generation import GENERATION_ENV
from distrun.launch.lifeline import (
    LAUNCHER_PID_ENV,
    die_with_launcher,
    die_with_parent,
    launcher_alive,
    pid_alive,
    pid_start_time,
)
from distrun.launch.local import STOP_GRACE, resolve_nproc, torchrun_env, warn_oversubscribed
from distrun.launch.ports import free_port
from distrun.launch.reaper import reaped
from distrun.launch.relay import RankOutput, Relay, new_tail, report_failure
from distrun.launch.run_folder import render_config
from distrun.loggers.plot import plot_run
from distrun.registry.collect import resolve_run_config
from distrun.spec.backends import BackendInfo
from distrun.spec.cluster import ClusterEnv
from distrun.spec.errors import EXIT_REQUEUE, DistrunError, UsageError, first_line
from distrun.spec.keys import CONSOLE_OWNER, DEVICE_MESH, JOINABLES, PARALLEL_DIMS, UNEVEN_EPOCH
from distrun.spec.markers import API_VERSION, hookimpl, hookspec
from distrun.spec.options import Option, plugin_options
from distrun.spec.stash import Stash, StashKey
from distrun.spec.strategy import SetupView, Strategy, StrategyInfo

if TYPE_CHECKING:
    from distrun.strategies.base import BaseStrategy
    from distrun.strategies.mesh import build_mesh
    from distrun.strategies.process_group import init_single_process_group, prepare_backend
    from distrun.train.rng import seed_everything
    from distrun.train.run import Run
    from distrun.train.schedulers import load_scheduler_states, scheduler_states
    from distrun.train.step_sync import STEP_SYNC
    from distrun.train.store_host import host_launcher_store, serve_store
    from distrun.train.tensors import to_cpu

__all__ = [
    # hooks and the API version
    "API_VERSION", "hookimpl", "hookspec",
    # options
    "Option", "RunConfig", "plugin_options", "with_values", "CONFIG_ENV",
    # strategies, backends, meshes
    "BackendInfo", "BaseStrategy", "ParallelDims", "SetupView", "Strategy", "StrategyInfo",
    "build_mesh", "init_single_process_group", "prepare_backend",
    # the run and its stash
    "Run", "Stash", "StashKey", "CONSOLE_OWNER", "DEVICE_MESH", "JOINABLES", "PARALLEL_DIMS",
    "STEP_SYNC", "UNEVEN_EPOCH",
    # errors and exit codes
    "DistrunError", "UsageError", "first_line", "EXIT_REQUEUE", "ExitWatch", "exit_code",
    # launching workers
    "ClusterEnv", "GENERATION_ENV", "LAUNCHER_PID_ENV", "LOOPBACK", "RUN_KEY_ENV",
    "STOP_GRACE", "STORE_FD_ENV", "bind_address", "fresh_run_folder", "interface_addresses",
    "listen_socket", "new_run_key", "resolve_host", "resolve_nproc", "resolve_run_config",
    "server_env", "torchrun_env", "warn_oversubscribed", "free_port",
    "host_launcher_store", "serve_store",
    # worker output
    "RankOutput", "Relay", "new_tail", "report_failure",
    # processes
    "die_with_launcher", "die_with_parent", "launcher_alive", "pid_alive", "pid_start_time",
    "reaped",
    # state and results
    "load_scheduler_states", "scheduler_states", "seed_everything", "to_cpu",
    "plot_run", "render_config",
]

#: names whose modules import torch, loaded on first use
_LAZY = {
    "BaseStrategy": "distrun.strategies.base",
    "build_mesh": "distrun.strategies.mesh",
    "init_single_process_group": "distrun.strategies.process_group",
    "prepare_backend": "distrun.strategies.process_group",
    "seed_everything": "distrun.train.rng",
    "Run": "distrun.train.run",
    "load_scheduler_states": "distrun.train.schedulers",
    "scheduler_states": "distrun.train.schedulers",
    "STEP_SYNC": "distrun.train.step_sync",
    "host_launcher_store": "distrun.train.store_host",
    "serve_store": "distrun.train.store_host",
    "to_cpu": "distrun.train.tensors",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'distrun.plugin' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
