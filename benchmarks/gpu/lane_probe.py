"""The GPU lane's probe plugin (``DISTRUN_PLUGINS=lane_probe``, this folder on PYTHONPATH).

At the end of a fit, rank 0 writes what the lane checks into ``GPU_LANE_PROBE`` (JSON): the
device the run trained on, the strategy, the default process group's backend, the logged
metrics and the CUDA memory peak. With ``GPU_LANE_EXPECTED`` it also writes every model and
optimizer tensor, gathered to full CPU tensors, as a safetensors file (what the checkpoint
cross-check compares against). With ``GPU_LANE_NCCL=1`` it joins a one-rank NCCL group at
configure time, before the strategy's setup, so a world-size-1 strategy runs over NCCL.
"""

from __future__ import annotations

import atexit
import json
import os
from typing import Any

from distrun.plugin import hookimpl

DISTRUN_PLUGIN_API = 1  # the distrun.plugin API this plugin is written for


@hookimpl
def distrun_configure(config: Any) -> None:
    if os.environ.get("GPU_LANE_NCCL") != "1":
        return
    import torch
    import torch.distributed as dist

    if dist.is_initialized() or not torch.cuda.is_available() or "RANK" not in os.environ:
        return
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=device)
    atexit.register(_destroy)


def _destroy() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


@hookimpl
def distrun_on_fit_end(run: Any) -> None:
    out = os.environ.get("GPU_LANE_PROBE")
    if not out:
        return
    import torch
    import torch.distributed as dist

    model = run.unwrapped_model()
    expected = os.environ.get("GPU_LANE_EXPECTED")
    tensors, error = None, None
    if expected:
        import sys

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from lane_tasks import full_state

        try:  # every rank: gathers are collectives
            tensors = full_state(model, run.optimizer)
        except Exception as exc:  # said in the probe's file; the run itself goes on
            error = f"{type(exc).__name__}: {exc}"
    if not run.is_global_zero:
        return
    params = list(model.parameters())
    info = {
        "device": str(run.device),
        "strategy": run.strategy.name,
        "world_size": run.world_size,
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "step": run.progress.step,
        "metrics": {k: float(v) for k, v in run.metrics.items()
                    if isinstance(v, (int, float))},
        "param_device": str(params[0].device) if params else None,
        "param_type": type(params[0]).__name__ if params else None,
        "cuda_max_allocated": (torch.cuda.max_memory_allocated()
                               if torch.cuda.is_available() else None),
        "expected_error": error,
    }
    if tensors is not None:
        from safetensors.torch import save_file

        save_file(tensors, expected)
        info["expected_tensors"] = len(tensors)
    with open(out, "w") as fh:
        json.dump(info, fh, indent=1)
