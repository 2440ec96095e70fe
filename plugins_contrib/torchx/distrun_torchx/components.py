"""TorchX components of distrun. TorchX lists every function here: keep only components."""

# No `from __future__ import annotations`: TorchX decodes arguments from the real types.
from typing import Dict, List, Optional  # noqa: UP035 (TorchX reads these annotations)

import torchx
from torchx import specs

from distrun_torchx import appdef as _appdef


def run(
    *script_args: str,
    script: str,
    nnodes: str = "1",
    nproc_per_node: int = 1,
    strategy: str = "auto",
    name: str = "",
    run_args: str = "",
    image: str = torchx.IMAGE,
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 1024,
    h: Optional[str] = None,  # noqa: UP007
    env: Optional[Dict[str, str]] = None,  # noqa: UP006, UP007
    max_retries: int = 0,
    rdzv_port: int = 29500,
    mounts: Optional[List[str]] = None,  # noqa: UP006, UP007
) -> specs.AppDef:
    """Runs a distrun task or a torchrun script with ``distrun run`` on every node.

    One replica per node, each a ``distrun run`` launcher starting ``nproc_per_node`` workers;
    several nodes meet through torch's c10d rendezvous hosted by replica 0 on ``rdzv_port``.

    Args:
        script_args: arguments of the script
        script: the script (or ``file.py:Task``), relative to the job's working directory
        nnodes: nodes, N or MIN:MAX (elastic, needs distrun-elastic in the image)
        nproc_per_node: worker processes per node
        strategy: distrun strategy (auto, ddp, fsdp, ...)
        name: job name (default: the script's name); the run folder is NAME-APP_ID
        run_args: more ``distrun run`` flags, e.g. "--max-steps 100 --resume auto"
        image: container image (schedulers that use one: kubernetes, docker, ...)
        cpu: CPUs per node
        gpu: GPUs per node
        memMB: memory per node in MB
        h: a named resource (takes precedence over cpu, gpu and memMB)
        env: environment variables of the workers, e.g. NAME=value,OTHER=value
        max_retries: times the scheduler may start a failed node again
        rdzv_port: port of the rendezvous store on replica 0's host (several nodes only)
        mounts: mounts for container schedulers, type=bind,src=/host,dst=/job[,readonly]
    """
    return _appdef.build_appdef(
        script, script_args, nnodes=nnodes, nproc_per_node=nproc_per_node, strategy=strategy,
        name=name, run_args=run_args, image=image, cpu=cpu, gpu=gpu, memMB=memMB, h=h, env=env,
        max_retries=max_retries, rdzv_port=rdzv_port, mounts=mounts)
