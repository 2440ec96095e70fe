"""The device mesh of a :class:`~distrun._config.parallel_dims.ParallelDims` layout."""

from __future__ import annotations

import datetime
from typing import Any

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from distrun._config.parallel_dims import ParallelDims
from distrun._strategies.process_group import device_backend

__all__ = ["build_mesh"]


def build_mesh(dims: ParallelDims, device_type: str, timeout: float | None = None) -> DeviceMesh:
    """``init_device_mesh`` of the layout ``dims``; the default process group must exist.

    Every dimension's group gets the collective ``timeout`` in seconds (torch would give
    sub-groups its 30-minute default).
    """
    kwargs: dict[str, Any] = {}
    override = _timeout_override(dims.mesh_dim_names, device_type, timeout)
    if override:
        kwargs["backend_override"] = override
    return init_device_mesh(device_type, dims.mesh_shape, mesh_dim_names=dims.mesh_dim_names,
                            **kwargs)


def _timeout_override(names: tuple[str, ...], device_type: str,
                      timeout: float | None) -> dict[str, Any] | None:
    if timeout is None:
        return None
    # the sub-groups use the default group's backend for this device (--backend)
    backend = device_backend(device_type) or ("nccl" if device_type == "cuda" else "gloo")
    opts: Any
    try:
        if backend == "gloo":
            # gloo's options class is private in torch 2.x; without it sub-groups keep torch's
            # default timeout, so a torch that lacks it falls through to that
            from torch._C._distributed_c10d import ProcessGroupGloo

            opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        elif backend == "nccl":
            from torch._C._distributed_c10d import ProcessGroupNCCL

            opts = ProcessGroupNCCL.Options()
        else:  # a plugin's backend: the generic options carry the timeout
            from torch._C._distributed_c10d import Backend

            opts = Backend.Options(backend)
        opts._timeout = datetime.timedelta(seconds=timeout)
    except (ImportError, AttributeError):
        return None
    return {name: (backend, opts) for name in names}
