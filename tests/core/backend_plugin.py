"""Backends offered through ``distrun_register_backends`` by a test plugin.

``gloo2`` is torch's gloo under a plugin's own name (registered with
``torch.distributed.Backend.register_backend`` when loaded, as a C++ extension's would be), so
the whole path of a plugin backend runs without a compiler: the launcher's checks, the
worker's check and load, a plain script's ``init_process_group()`` and the mesh's sub-groups.
``never`` is one whose check says it cannot run here. Loaded with
``DISTRUN_PLUGINS=backend_plugin`` (this folder on PYTHONPATH).
"""

from __future__ import annotations

from distrun.plugin import BackendInfo, hookimpl

LOADS_FILE_ENV = "BACKEND_PLUGIN_LOADS"


def load_gloo2() -> None:
    import os

    import torch.distributed as dist
    from torch._C._distributed_c10d import ProcessGroupGloo

    if hasattr(dist.Backend, "GLOO2"):
        return
    path = os.environ.get(LOADS_FILE_ENV)
    if path:  # the test counts loads: once per worker
        with open(path, "a") as fh:
            fh.write(f"{os.getpid()}\n")

    def make(store, rank, size, timeout):
        return ProcessGroupGloo(store, rank, size, timeout)

    dist.Backend.register_backend("gloo2", make, devices=["cpu"])


def _never() -> str:
    return "it needs a device this machine lacks"


@hookimpl
def distrun_register_backends(register):
    register(BackendInfo("gloo2", ("cpu",), check=lambda: None,
                         load="backend_plugin:load_gloo2", single_node=True,
                         help="gloo under a plugin's name", plugin="backend_plugin"))
    register(BackendInfo("never", ("cpu",), check=_never, load="backend_plugin:load_gloo2",
                         plugin="backend_plugin"))
