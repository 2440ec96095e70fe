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

from distrun._config.parallel_dims import ParallelDims
from distrun._config.run_config import CONFIG_ENV, RunConfig, with_values
from distrun._config.run_dir import fresh_run_folder
from distrun._launch.binding import (
    LOOPBACK,
    STORE_FD_ENV,
    bind_address,
    interface_addresses,
    listen_socket,
    server_env,
)
from distrun._launch.binding import resolve as resolve_host
from distrun._launch.exits import ExitWatch, exit_code
from distrun._launch.folder_lock import RUN_KEY_ENV, new_run_key
from distrun._launch.generation import GENERATION_ENV
from distrun._launch.group import (
    STOP_GRACE,
    NodeRanks,
    WorkerGroup,
    WorkerOutputs,
    node_services,
    torchrun_env,
    wait_with_signals,
    worker_outputs,
)
from distrun._launch.lifeline import (
    LAUNCHER_PID_ENV,
    die_with_launcher,
    die_with_parent,
    launcher_alive,
    pid_alive,
    pid_start_time,
)
from distrun._launch.local import resolve_nproc, warn_oversubscribed
from distrun._launch.ports import free_port
from distrun._launch.reaper import reaped
from distrun._launch.relay import RankOutput, Relay, new_tail, report_failure
from distrun._launch.run_folder import render_config
from distrun._launch.warm import WarmPool, WarmProcess, warm_command
from distrun._loggers.plot import plot_run
from distrun._registry.collect import requested_degrees, resolve_run_config
from distrun._spec.backends import BackendInfo
from distrun._spec.cluster import ClusterEnv
from distrun._spec.errors import EXIT_REQUEUE, DistrunError, UsageError, first_line
from distrun._spec.keys import (
    COMPILE_TIME,
    CONSOLE_OWNER,
    DEVICE_MESH,
    JOINABLES,
    PARALLEL_DIMS,
    UNEVEN_EPOCH,
)
from distrun._spec.markers import API_VERSION, hookimpl, hookspec
from distrun._spec.node import NodeService
from distrun._spec.options import Option, PluginOptions, option, plugin_options
from distrun._spec.stash import Stash, StashKey
from distrun._spec.strategy import SetupView, Strategy, StrategyInfo

if TYPE_CHECKING:
    from distrun._strategies.base import BaseStrategy
    from distrun._strategies.mesh import build_mesh
    from distrun._strategies.process_group import init_single_process_group, prepare_backend
    from distrun._train.rng import seed_everything
    from distrun._train.run import Run
    from distrun._train.sampler import epoch_permutation
    from distrun._train.schedulers import load_scheduler_states, scheduler_states
    from distrun._train.step_sync import STEP_SYNC
    from distrun._train.tensors import to_cpu
    from distrun._worker.store import host_launcher_store, serve_store

__all__ = [
    # hooks and the API version
    "API_VERSION", "hookimpl", "hookspec",
    # options
    "Option", "PluginOptions", "RunConfig", "option", "plugin_options", "with_values",
    "CONFIG_ENV",
    # strategies, backends, meshes
    "BackendInfo", "BaseStrategy", "ParallelDims", "SetupView", "Strategy", "StrategyInfo",
    "requested_degrees",
    "build_mesh", "init_single_process_group", "prepare_backend",
    # the run and its stash
    "Run", "Stash", "StashKey", "COMPILE_TIME", "CONSOLE_OWNER", "DEVICE_MESH", "JOINABLES",
    "PARALLEL_DIMS", "STEP_SYNC", "UNEVEN_EPOCH",
    # errors and exit codes
    "DistrunError", "UsageError", "first_line", "EXIT_REQUEUE", "ExitWatch", "exit_code",
    # launching workers
    "ClusterEnv", "GENERATION_ENV", "LAUNCHER_PID_ENV", "LOOPBACK", "RUN_KEY_ENV",
    "STOP_GRACE", "STORE_FD_ENV", "bind_address", "fresh_run_folder", "interface_addresses",
    "listen_socket", "new_run_key", "resolve_host", "resolve_nproc", "resolve_run_config",
    "server_env", "torchrun_env", "warn_oversubscribed", "free_port",
    "NodeRanks", "NodeService", "WorkerGroup", "WorkerOutputs", "node_services",
    "wait_with_signals", "worker_outputs",
    "host_launcher_store", "serve_store", "WarmPool", "WarmProcess", "warm_command",
    # worker output
    "RankOutput", "Relay", "new_tail", "report_failure",
    # processes
    "die_with_launcher", "die_with_parent", "launcher_alive", "pid_alive", "pid_start_time",
    "reaped",
    # state and results
    "load_scheduler_states", "scheduler_states", "seed_everything", "to_cpu",
    "epoch_permutation", "plot_run", "render_config",
]

#: names whose modules import torch, loaded on first use
_LAZY = {
    "BaseStrategy": "distrun._strategies.base",
    "build_mesh": "distrun._strategies.mesh",
    "init_single_process_group": "distrun._strategies.process_group",
    "prepare_backend": "distrun._strategies.process_group",
    "seed_everything": "distrun._train.rng",
    "Run": "distrun._train.run",
    "load_scheduler_states": "distrun._train.schedulers",
    "scheduler_states": "distrun._train.schedulers",
    "STEP_SYNC": "distrun._train.step_sync",
    "host_launcher_store": "distrun._worker.store",
    "serve_store": "distrun._worker.store",
    "to_cpu": "distrun._train.tensors",
    "epoch_permutation": "distrun._train.sampler",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'distrun.plugin' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
