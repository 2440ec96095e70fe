"""Job files for schedulers: a SLURM batch script and a Kubeflow PyTorchJob manifest (torch-free).

Both start ``distrun run`` once per node (or once per rank with SLURM ``per_task``) and leave
the layout to the cluster-environment detection, so the script itself carries no rank, node
list or master address. Both pass ``--resume auto`` and a run name stable across restarts, so
a requeued job or a restarted pod continues from the newest checkpoint of the run.

Every value the user gave is quoted for whoever reads it (bash, sbatch's ``#SBATCH`` parser,
YAML) and checked first (:func:`check_spec`): a job file runs later, on other machines, so a
name such as ``$(touch x)`` must arrive as text and a newline must not start a new line.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from distrun.plugin import UsageError

__all__ = ["JobSpec", "check_spec", "render_pytorchjob", "render_sbatch"]

#: a Kubernetes object name or namespace (an RFC 1123 label)
K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
#: what the job file may hold unquoted: shlex's safe characters, literal to sbatch as well
_PLAIN = re.compile(r"^[\w@%+=:,./-]+$", re.ASCII)


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


def check_spec(spec: JobSpec, kind: str) -> None:
    """Refuse, in one line, a value no job file can carry as given (``kind``: slurm, k8s).

    A control character (a newline, an escape) in any value; a job name that cannot be a run
    folder's name (the run is named after the job); a Kubernetes name or namespace that is
    not a lowercase DNS label.
    """
    values = {"--job-name": spec.name, "--mem": spec.memory, "--time": spec.time,
              "--partition": spec.partition, "--account": spec.account,
              "--image": spec.image, "--namespace": spec.namespace}
    for flag, value in values.items():
        if _CONTROL.search(value):
            raise UsageError(f"{flag} {value!r} holds a control character (a newline, tab or "
                             "escape); give it on one line, in printable characters")
    if not spec.name:
        raise UsageError("--job-name is empty: give a name, or leave the flag out for the "
                         "script's name")
    if "/" in spec.name or "\\" in spec.name or ".." in spec.name or spec.name == ".":
        raise UsageError(f"--job-name {spec.name!r} is also the run folder's name: no '/', "
                         "'\\' or '..' (choose a plain name)")
    if kind == "k8s":
        for flag, value in (("--job-name", spec.name), ("--namespace", spec.namespace)):
            if value and not K8S_NAME.match(value):
                raise UsageError(f"{flag} {value!r} is not a Kubernetes name (lowercase "
                                 "letters, digits and '-')")


def _sbatch_value(value: str) -> str:
    """``value`` as one ``#SBATCH`` argument: sbatch's own parser (not bash) reads these
    lines; it ends an argument at a blank or an unquoted ``#`` and honours ``"..."`` and
    backslash escapes (old releases only those), so a backslash-escaped, double-quoted value
    reaches it whole in every release."""
    if _PLAIN.match(value):
        return value
    escaped = "".join("\\" + c if c in '\\"#' else c for c in value)
    return f'"{escaped}"'


def _run_command(spec: JobSpec, name: str, layout: bool) -> list[str]:
    cmd = ["distrun", "run"]
    if layout:
        cmd += ["--nproc-per-node", str(spec.nproc_per_node)]
    return [*cmd, "--resume", "auto", "--name", name, *spec.run_args]


def render_sbatch(spec: JobSpec) -> str:
    """A batch script for ``sbatch``: one srun task per node (or per rank with ``per_task``)."""
    check_spec(spec, "slurm")
    tasks = spec.nproc_per_node if spec.per_task else 1
    cpus = spec.cpus_per_node or 2 * spec.nproc_per_node
    lines = [
        "#!/bin/bash",
        "# Rendered by `distrun submit --slurm`; submit it with `sbatch FILE`.",
        f"#SBATCH --job-name={_sbatch_value(spec.name)}",
        f"#SBATCH --nodes={spec.nodes}",
        f"#SBATCH --ntasks-per-node={tasks}",
        f"#SBATCH --cpus-per-task={max(1, cpus // tasks)}",
    ]
    if spec.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={spec.gpus_per_node}")
    if spec.memory:
        lines.append(f"#SBATCH --mem={_sbatch_value(spec.memory)}")
    if spec.time:
        lines.append(f"#SBATCH --time={_sbatch_value(spec.time)}")
    if spec.partition:
        lines.append(f"#SBATCH --partition={_sbatch_value(spec.partition)}")
    if spec.account:
        lines.append(f"#SBATCH --account={_sbatch_value(spec.account)}")
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
    # the same name on every node and across requeues: the job's name, quoted for bash as
    # text, then the job id, which bash expands when the job runs
    marker = "\0JOB\0"  # no user value holds a NUL (check_spec)
    command = _run_command(spec, marker, layout=not spec.per_task)
    quoted = " ".join(_job_named(spec.name) if a == marker else shlex.quote(a) for a in command)
    lines += [f"srun --kill-on-bad-exit=1 {quoted}", ""]
    return "\n".join(lines)


def _job_named(name: str) -> str:
    """``NAME-$SLURM_JOB_ID`` for bash: the name as literal text, the id expanded."""
    if _PLAIN.match(name):  # nothing in it that double quotes would change
        return f'"{name}-$SLURM_JOB_ID"'
    return shlex.quote(name) + '"-$SLURM_JOB_ID"'


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
    check_spec(spec, "k8s")
    meta = [f"  name: {spec.name}"]  # both DNS labels (check_spec): plain YAML scalars
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
