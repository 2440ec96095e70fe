"""Job files for schedulers: a SLURM batch script and a Kubeflow PyTorchJob manifest (torch-free).

Both start ``distrun run`` once per node (or once per rank with SLURM ``per_task``) and leave
the layout to the cluster-environment detection, so the script itself carries no rank, node
list or master address. Both pass ``--resume auto`` and a run name stable across restarts, so
a requeued job or a restarted pod continues from the newest checkpoint of the run.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["JobSpec", "render_pytorchjob", "render_sbatch"]


@dataclass(frozen=True)
class JobSpec:
    """What a job asks of the scheduler, and the ``distrun run`` arguments it runs."""

    name: str
    run_args: Sequence[str]
    nodes: int = 1
    nproc_per_node: int = 1
    gpus_per_node: int = 0
    cpus_per_node: int = 0
    time: str = ""
    partition: str = ""
    account: str = ""
    per_task: bool = False
    image: str = ""
    namespace: str = ""
    memory: str = ""


def _run_command(spec: JobSpec, name: str, layout: bool) -> list[str]:
    cmd = ["distrun", "run"]
    if layout:
        cmd += ["--nproc-per-node", str(spec.nproc_per_node)]
    return [*cmd, "--resume", "auto", "--name", name, *spec.run_args]


def render_sbatch(spec: JobSpec) -> str:
    """A batch script for ``sbatch``: one srun task per node (or per rank with ``per_task``)."""
    tasks = spec.nproc_per_node if spec.per_task else 1
    cpus = spec.cpus_per_node or 2 * spec.nproc_per_node
    lines = [
        "#!/bin/bash",
        "# Rendered by `distrun submit --slurm`; submit it with `sbatch FILE`.",
        f"#SBATCH --job-name={spec.name}",
        f"#SBATCH --nodes={spec.nodes}",
        f"#SBATCH --ntasks-per-node={tasks}",
        f"#SBATCH --cpus-per-task={max(1, cpus // tasks)}",
    ]
    if spec.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={spec.gpus_per_node}")
    if spec.memory:
        lines.append(f"#SBATCH --mem={spec.memory}")
    if spec.time:
        lines.append(f"#SBATCH --time={spec.time}")
    if spec.partition:
        lines.append(f"#SBATCH --partition={spec.partition}")
    if spec.account:
        lines.append(f"#SBATCH --account={spec.account}")
    lines += [
        "#SBATCH --output=%x-%j.out",
        "#SBATCH --open-mode=append",
        "# SIGTERM to every task 120 s before the time limit: distrun saves a checkpoint at the",
        "# next step and exits 143; a requeued job resumes from it (--resume auto).",
        "#SBATCH --signal=TERM@120",
        "#SBATCH --requeue",
        "",
        "set -euo pipefail",
        "",
    ]
    if spec.per_task:
        lines += [
            "# One srun task per rank: distrun-cluster-env reads SLURM_PROCID, SLURM_LOCALID,",
            "# SLURM_NTASKS and the node list, and each launcher runs its one rank in place.",
        ]
    else:
        lines += [
            "# One srun task per node: distrun-cluster-env reads SLURM_NNODES, SLURM_NODEID and",
            "# the node list (its first host is the master address), and each launcher starts",
            "# this node's workers.",
        ]
    name = f"{spec.name}-$SLURM_JOB_ID"  # the same on every node and across requeues
    command = _run_command(spec, name, layout=not spec.per_task)
    quoted = " ".join('"' + a + '"' if a == name else shlex.quote(a) for a in command)
    lines += [f"srun --kill-on-bad-exit=1 {quoted}", ""]
    return "\n".join(lines)


def _container(spec: JobSpec) -> list[str]:
    command = _run_command(spec, spec.name, layout=True)
    limits = [f'cpu: "{spec.cpus_per_node or 2 * spec.nproc_per_node}"']
    if spec.memory:
        limits.append(f"memory: {json.dumps(spec.memory)}")
    if spec.gpus_per_node:
        limits.append(f'nvidia.com/gpu: "{spec.gpus_per_node}"')
    out = [
        "          containers:",
        "            - name: pytorch  # the operator looks for this name",
        f"              image: {json.dumps(spec.image or 'YOUR_IMAGE_WITH_DISTRUN')}",
        f"              command: {json.dumps(command)}",
        "              resources:",
        "                limits:",
        *(f"                  {lim}" for lim in limits),
    ]
    return out


def render_pytorchjob(spec: JobSpec) -> str:
    """A Kubeflow PyTorchJob: one Master pod and ``nodes - 1`` Worker pods, one launcher each."""
    meta = [f"  name: {spec.name}"]
    if spec.namespace:
        meta.append(f"  namespace: {spec.namespace}")
    lines = [
        "# Rendered by `distrun submit --k8s`; apply it with `kubectl apply -f FILE`.",
        "# The training operator sets MASTER_ADDR, MASTER_PORT, RANK (the pod's index),",
        "# WORLD_SIZE and PET_*; distrun-cluster-env turns them into nodes and ranks.",
        "apiVersion: kubeflow.org/v1",
        "kind: PyTorchJob",
        "metadata:",
        *meta,
        "spec:",
        f'  nprocPerNode: "{spec.nproc_per_node}"',
        "  runPolicy:",
        "    backoffLimit: 3  # restarted pods resume from the newest checkpoint (--resume auto)",
        "  pytorchReplicaSpecs:",
    ]
    for role, replicas in (("Master", 1), ("Worker", spec.nodes - 1)):
        if replicas < 1:
            continue
        lines += [
            f"    {role}:",
            f"      replicas: {replicas}",
            "      restartPolicy: OnFailure",
            "      template:",
            "        spec:",
            *_container(spec),
        ]
    return "\n".join(lines) + "\n"
