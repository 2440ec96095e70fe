"""`distrun submit` renders job files; the examples are its output; a rendered script runs."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from distrun.testing import free_port

ROOT = Path(__file__).resolve().parents[3]
RUN_ARGS = ["--", "--strategy", "ddp", "--max-epochs", "3", "examples/digits.py"]
EXAMPLES = {  # committed example -> the command that renders it
    "examples/slurm/digits.sbatch": ["--slurm", "--nodes", "2", "--nproc-per-node", "2",
                                     "--time", "00:30:00", "--job-name", "digits"],
    "examples/slurm/digits-per-task.sbatch": ["--slurm", "--nodes", "2", "--nproc-per-node",
                                              "2", "--time", "00:30:00", "--per-task",
                                              "--job-name", "digits"],
    "examples/k8s/digits-pytorchjob.yaml": ["--k8s", "--nodes", "2", "--nproc-per-node", "2",
                                            "--job-name", "digits", "--image",
                                            "ghcr.io/example/distrun:0.1"],
}


def _sbatch_options(text: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, flags=re.M))


@pytest.mark.parametrize("example", list(EXAMPLES))
def test_examples_are_what_submit_renders(h, tmp_path, example):
    result = h.distrun("submit", *EXAMPLES[example], "--dry-run", *RUN_ARGS,
                       env=h.base_env(), cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == (ROOT / example).read_text(), f"re-render {example}"


def test_sbatch_scripts(h, tmp_path):
    per_node = (ROOT / "examples/slurm/digits.sbatch").read_text()
    per_task = (ROOT / "examples/slurm/digits-per-task.sbatch").read_text()
    for text in (per_node, per_task):
        check = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True)
        assert check.returncode == 0, check.stderr
    assert _sbatch_options(per_node) == {
        "job-name": "digits", "nodes": "2", "ntasks-per-node": "1", "cpus-per-task": "4",
        "time": "00:30:00", "output": "%x-%j.out", "open-mode": "append",
        "signal": "TERM@120"}
    assert _sbatch_options(per_task)["ntasks-per-node"] == "2"
    assert _sbatch_options(per_task)["cpus-per-task"] == "2"
    srun = [ln for ln in per_node.splitlines() if ln.startswith("srun ")]
    assert srun == ['srun --kill-on-bad-exit=1 distrun run --nproc-per-node 2 --resume auto '
                    '--name "digits-$SLURM_JOB_ID" --strategy ddp --max-epochs 3 '
                    'examples/digits.py']
    assert "--nproc-per-node" not in per_task.split("srun ", 1)[1]  # the tasks are the ranks


COMMAND = ["distrun", "run", "--nproc-per-node", "2", "--resume", "auto", "--name", "digits",
           "--strategy", "ddp", "--max-epochs", "3", "examples/digits.py"]


def test_pytorchjob_manifest():
    text = (ROOT / "examples/k8s/digits-pytorchjob.yaml").read_text()
    try:
        import yaml
    except ImportError:  # no PyYAML: the same facts, read from the text
        assert "apiVersion: kubeflow.org/v1\nkind: PyTorchJob\n" in text
        assert '  nprocPerNode: "2"' in text and "  name: digits" in text
        assert re.findall(r"^    (\w+):\n      replicas: (\d+)", text, flags=re.M) == [
            ("Master", "1"), ("Worker", "1")]
        assert text.count("- name: pytorch") == 2
        assert text.count(f"command: {json.dumps(COMMAND)}") == 2
        return
    job = yaml.safe_load(text)
    assert (job["apiVersion"], job["kind"], job["metadata"]["name"]) == (
        "kubeflow.org/v1", "PyTorchJob", "digits")
    assert job["spec"]["nprocPerNode"] == "2"
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert {k: v["replicas"] for k, v in specs.items()} == {"Master": 1, "Worker": 1}
    for role in specs.values():
        (container,) = role["template"]["spec"]["containers"]
        assert container["name"] == "pytorch"
        assert container["image"] == "ghcr.io/example/distrun:0.1"
        assert container["command"] == COMMAND
        assert container["resources"]["limits"] == {"cpu": "4"}


def test_submit_errors_are_one_line(h, cli, tmp_path):
    cases = [
        (["--dry-run", "x.py"], "error: say where to submit: --slurm or --k8s"),
        (["--k8s", "--job-name", "Bad_Name", "--dry-run", "x.py"],
         "error: --job-name 'Bad_Name' is not a Kubernetes name (lowercase letters, digits "
         "and '-')"),
        (["--slurm", "x.py"], "error: sbatch is not on PATH (use --dry-run to print the job "
                              "file, or -o FILE to write it)"),
    ]
    env = h.cli_env(PATH=os.path.dirname(sys.executable))  # no sbatch there
    for args, message in cases:
        result = cli("submit", *args, env=env, cwd=tmp_path)
        assert (result.returncode, result.stderr.strip()) == (2, message)


FAKE_SRUN = """#!{python}
# srun for one machine: start one task per (fake) node with SLURM's task variables.
import os, subprocess, sys
argv = [a for a in sys.argv[1:] if not a.startswith("--kill-on-bad-exit")]
nodes = int(os.environ["FAKE_NODES"])
procs = []
for node in range(nodes):
    env = dict(os.environ, SLURM_PROCID=str(node), SLURM_LOCALID="0", SLURM_NODEID=str(node),
               SLURM_NTASKS=str(nodes), SLURM_NNODES=str(nodes), SLURM_TASKS_PER_NODE="1(x%d)" % nodes,
               SLURM_NODELIST="localhost")
    procs.append(subprocess.Popen(argv, env=env))
sys.exit(max(p.wait() for p in procs))
"""


@pytest.mark.slow
def test_a_rendered_sbatch_script_runs_under_srun(h, tmp_path, probe):
    """The per-node script, run by bash with an srun that fakes two nodes on this machine."""
    script = h.distrun("submit", "--slurm", "--nodes", "2", "--nproc-per-node", "2",
                       "--job-name", "probe", "--dry-run", "--", str(probe), str(tmp_path),
                       env=h.base_env(), cwd=tmp_path, timeout=120)
    assert script.returncode == 0, script.stderr
    bindir = tmp_path / "bin"
    bindir.mkdir()
    srun = bindir / "srun"
    srun.write_text(FAKE_SRUN.format(python=sys.executable))
    srun.chmod(srun.stat().st_mode | stat.S_IXUSR)
    distrun_bin = Path(sys.executable).parent / "distrun"
    env = h.base_env(PATH=f"{bindir}:{distrun_bin.parent}:{os.environ['PATH']}", FAKE_NODES="2",
                     SLURM_JOB_ID="777", MASTER_PORT=str(free_port()))
    proc = subprocess.run(["bash", "-c", script.stdout], env=env, cwd=tmp_path, text=True,
                          capture_output=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    infos = h.read_ranks(tmp_path, 4)
    assert [(i["RANK"], i["GROUP_RANK"], i["LOCAL_RANK"]) for i in infos] == [
        ("0", "0", "0"), ("1", "0", "1"), ("2", "1", "0"), ("3", "1", "1")]
    assert {i["WORLD_SIZE"] for i in infos} == {"4"} and infos[0]["sum"] == 6.0
    assert {i["MASTER_ADDR"] for i in infos} == {"localhost"}
    assert (tmp_path / "runs" / "probe-777").is_dir()  # one run folder for both "nodes"
