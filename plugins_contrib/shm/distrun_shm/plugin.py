"""Entry point of distrun-shm: offers the ``shm`` backend (torch-free at import)."""

from __future__ import annotations

from distrun.plugin import BackendInfo, hookimpl

DISTRUN_PLUGIN_API = 1  # the distrun.plugin API this plugin is written for


@hookimpl
def distrun_register_backends(register):
    register(BackendInfo(
        "shm", ("cpu",), check="distrun_shm.build:unavailable", load="distrun_shm.backend:load",
        single_node=True, plugin="distrun-shm",
        help="POSIX shared memory between the ranks of one machine (CPU tensors; "
             "compiled on first use)"))


@hookimpl
def distrun_add_commands(cli):
    from distrun_shm.cli import shm

    cli.add_command(shm)
