"""``distrun submit``: render a SLURM batch script or a PyTorchJob, print/write it or submit it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import click

from distrun.plugin import UsageError
from distrun_cluster_env.templates import JobSpec, check_spec, render_pytorchjob, render_sbatch

__all__ = ["submit_cmd"]


def _default_name(run_args: tuple[str, ...]) -> str:
    target = next((a for a in run_args if a.endswith(".py") or ":" in a), "distrun")
    stem = os.path.splitext(os.path.basename(target.rpartition(":")[0] or target))[0]
    return re.sub(r"[^a-z0-9-]+", "-", stem.lower()).strip("-") or "distrun"


@click.command("submit", context_settings={"allow_interspersed_args": False})
@click.option("--slurm", "kind", flag_value="slurm", help="render an sbatch script")
@click.option("--k8s", "kind", flag_value="k8s", help="render a Kubeflow PyTorchJob manifest")
@click.option("--nodes", type=click.IntRange(min=1), default=1, show_default=True,
              help="nodes (SLURM) or pods (Kubernetes)")
@click.option("--nproc-per-node", type=click.IntRange(min=1), default=1, show_default=True,
              help="ranks per node")
@click.option("--gpus-per-node", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--cpus-per-node", type=click.IntRange(min=0), default=0,
              help="CPUs per node (default: 2 per rank)")
@click.option("--mem", "memory", default="", help="memory per node, e.g. 64G (SLURM) or 64Gi")
@click.option("--time", "time_limit", default="", help="SLURM time limit, e.g. 02:00:00")
@click.option("--partition", default="", help="SLURM partition")
@click.option("--account", default="", help="SLURM account")
@click.option("--per-task", is_flag=True,
              help="SLURM: one srun task per rank (each runs in place) instead of one per node")
@click.option("--image", default="", help="Kubernetes: container image with distrun installed")
@click.option("--namespace", default="", help="Kubernetes namespace")
@click.option("--job-name", default=None, help="job and run name (default: the script's name)")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="write the job file here instead of submitting it")
@click.option("--dry-run", is_flag=True, help="print the job file, submit nothing")
@click.argument("run_args", nargs=-1, type=click.UNPROCESSED, required=True)
def submit_cmd(kind: str | None, nodes: int, nproc_per_node: int, gpus_per_node: int,
               cpus_per_node: int, memory: str, time_limit: str, partition: str, account: str,
               per_task: bool, image: str, namespace: str, job_name: str | None, output: str | None,
               dry_run: bool, run_args: tuple[str, ...]) -> None:
    """Submit `distrun run RUN_ARGS` to SLURM or Kubernetes (give run options after `--`).

    \b
    distrun submit --slurm --nodes 2 --nproc-per-node 4 --dry-run -- --strategy ddp train.py
    """
    if kind is None:
        raise UsageError("say where to submit: --slurm or --k8s")
    name = _default_name(run_args) if job_name is None else job_name
    if per_task and kind != "slurm":
        raise UsageError("--per-task is for --slurm (a PyTorchJob runs one launcher per pod)")
    spec = JobSpec(name=name, run_args=run_args, nodes=nodes, nproc_per_node=nproc_per_node,
                   gpus_per_node=gpus_per_node, cpus_per_node=cpus_per_node, time=time_limit,
                   partition=partition, account=account, per_task=per_task, image=image,
                   namespace=namespace, memory=memory)
    check_spec(spec, kind)
    text = render_sbatch(spec) if kind == "slurm" else render_pytorchjob(spec)
    if dry_run:
        click.echo(text, nl=False)
        return
    if output:
        _write_job_file(output, text)
        click.echo(f"wrote {output}", err=True)
        return
    tool = ["sbatch"] if kind == "slurm" else ["kubectl", "apply", "-f", "-"]
    if shutil.which(tool[0]) is None:
        raise UsageError(f"{tool[0]} is not on PATH (use --dry-run to print the job file, or "
                         "-o FILE to write it)")
    proc = subprocess.run(tool, input=text, text=True)
    if proc.returncode != 0:
        raise UsageError(f"{' '.join(tool)} failed with exit code {proc.returncode}")


def _write_job_file(path: str, text: str) -> None:
    """Write the job file whole or not at all: a half-written script must never be submitted."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise UsageError(f"cannot write the job file {path}: {exc.strerror} (choose another "
                         "-o path, or use --dry-run to print it)") from None
