"""The command and the AppDef behind the ``distrun.run`` component (torchx imported lazily).

Kept apart from :mod:`distrun_torchx.components` because TorchX lists every function of a
component module as a component.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["distrun_command", "parse_nnodes", "build_appdef"]

#: the name of the port TorchX's schedulers open between replicas for the rendezvous store
RDZV_PORT_NAME = "c10d"


class _Raw(str):
    """A shell word left unquoted: it holds a ``$`` expansion done by the replica's bash."""


def parse_nnodes(nnodes: str) -> tuple[int, int]:
    """``"2"`` -> (2, 2); ``"1:4"`` -> (1, 4) (elastic: the job starts with the minimum)."""
    lo, sep, hi = nnodes.partition(":")
    try:
        low, high = int(lo), int(hi if sep else lo)
    except ValueError:
        raise ValueError(f"nnodes must be N or MIN:MAX, got {nnodes!r}") from None
    if not 1 <= low <= high:
        raise ValueError(f"nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, got {nnodes!r}")
    return low, high


def distrun_command(script: str, script_args: Sequence[str], *, nnodes: str,
                    nproc_per_node: int, strategy: str, run_name: str, run_args: str,
                    rdzv_host: str, rdzv_port: int, rdzv_id: str) -> str:
    """The bash command line every replica runs (one ``distrun run`` launcher per node).

    One node: a plain local launch (torch's store on 127.0.0.1, a free port). Several nodes:
    torch's c10d rendezvous through the elastic plugin, hosted by replica 0 on ``rdzv_port``,
    ``rdzv_host`` being a shell expansion of the variable the scheduler fills with replica 0's
    host name (the way TorchX's own ``dist.ddp`` does it).
    """
    _, high = parse_nnodes(nnodes)
    words: list[str] = ["distrun", "run", "--nproc-per-node", str(nproc_per_node),
                        "--strategy", strategy, "--name", run_name]
    if high > 1:
        words += ["--nnodes", nnodes, "--rdzv-backend", "c10d",
                  "--rdzv-endpoint", _Raw(f"{rdzv_host}:{rdzv_port}"), "--rdzv-id", rdzv_id]
    words += shlex.split(run_args)
    words += [script, *script_args]
    return " ".join(w if isinstance(w, _Raw) else shlex.quote(w) for w in words)


def build_appdef(script: str, script_args: Sequence[str], *, nnodes: str, nproc_per_node: int,
                 strategy: str, name: str, run_args: str, image: str, cpu: int, gpu: int,
                 memMB: int, h: str | None, env: dict[str, str] | None, max_retries: int,
                 rdzv_port: int, mounts: list[str] | None) -> Any:
    """The :class:`torchx.specs.AppDef` of ``distrun.run`` (see its docstring for the knobs)."""
    from torchx import specs

    if nproc_per_node < 1:
        raise ValueError(f"nproc_per_node must be >= 1, got {nproc_per_node}")
    low, high = parse_nnodes(nnodes)
    stem = Path(script.partition(":")[0]).stem or "distrun"
    app_name = name or stem
    # One run folder per TorchX job (its app id, already "NAME-xxxx"), the same on every node
    # and for every retry, so `--resume auto` in run_args continues from its newest checkpoint.
    run_name = specs.macros.app_id
    rdzv_host = f"${{{specs.macros.rank0_env}:=localhost}}"
    command = distrun_command(
        script, script_args, nnodes=nnodes, nproc_per_node=nproc_per_node, strategy=strategy,
        run_name=run_name, run_args=run_args, rdzv_host=rdzv_host, rdzv_port=rdzv_port,
        rdzv_id=specs.macros.app_id)
    role_env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    role = specs.Role(
        name=stem, image=image, entrypoint="bash", args=["-c", command], env=role_env,
        num_replicas=high, min_replicas=low if low != high else None,
        resource=specs.resource(cpu=cpu, gpu=gpu, memMB=memMB, h=h),
        port_map={RDZV_PORT_NAME: rdzv_port}, max_retries=max_retries,
        mounts=specs.parse_mounts(mounts) if mounts else [])
    return specs.AppDef(name=app_name, roles=[role])
