"""`distrun submit` quotes every value it renders and refuses what no job file can carry.

A job file runs later, on other machines: a job name such as ``$(touch x)`` must reach the
run as text (never run when the job runs), and a newline must not start a line of its own.
The sbatch scripts are run by bash with an ``srun`` that records its arguments; their
``#SBATCH`` lines are read the way sbatch reads them; manifests are loaded as YAML.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

#: names that break or run code when pasted into a script unquoted (no '/': it is a run name)
HOSTILE = [
    "$(touch x)",
    "`touch y` and ${HOME}",
    'say "hi"; touch z',
    "it's #1 & more",
    "tab-free  spaces   ",
    "a!b*c?[d]~e",
]

FAKE_SRUN = """#!/bin/sh
# srun that records its arguments, one per NUL-terminated record
for a in "$@"; do printf '%s\\0' "$a"; done > "$SRUN_ARGS"
"""


def _sbatch_args(text: str, old: bool = False) -> list[str]:
    """The arguments sbatch reads from the rest of one ``#SBATCH`` line.

    Current sbatch: blanks separate arguments, ``"..."`` and ``'...'`` quote, a backslash
    escapes the next character and an unquoted ``#`` starts a comment. ``old``: releases before
    that, where only ``"`` quotes and any unescaped ``#`` ends the line.
    """
    out: list[str] = []
    cur: list[str] = []
    quote, escaped, started = "", False, False
    for c in text:
        if escaped:
            cur.append(c)
            escaped = False
        elif c == "\\":
            escaped = started = True
        elif c == "#" and (old or not quote):
            break
        elif quote:
            if c == quote:
                quote = ""
            else:
                cur.append(c)
        elif c == '"' or (c == "'" and not old):
            quote, started = c, True
        elif c.isspace():
            if started:
                out.append("".join(cur))
                cur, started = [], False
        else:
            cur.append(c)
            started = True
    assert not quote, f"unmatched quote in #SBATCH{text}"
    if started:
        out.append("".join(cur))
    return out


def _directives(script: str, old: bool = False) -> dict[str, str]:
    out = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH"):
            (arg,) = _sbatch_args(line[len("#SBATCH"):], old)
            key, _, value = arg.partition("=")
            out[key.removeprefix("--")] = value
    return out


def _render(cli, h, tmp_path, *args: str) -> str:
    result = cli("submit", *args, env=h.cli_env(), cwd=tmp_path)
    assert result.returncode == 0, result
    return result.stdout


@pytest.mark.parametrize("per_task", [False, True], ids=["per-node", "per-task"])
def test_hostile_values_reach_the_run_and_sbatch_as_text(cli, h, tmp_path, per_task):
    work = tmp_path / "work"
    work.mkdir()
    bindir = tmp_path / "bin"
    bindir.mkdir()
    srun = bindir / "srun"
    srun.write_text(FAKE_SRUN)
    srun.chmod(srun.stat().st_mode | stat.S_IXUSR)
    partition, account = "gpu #1 \"big\"", "q\\z 'x'"
    script_arg = "$(touch w).py"
    for name in HOSTILE:
        script = _render(cli, h, tmp_path, "--slurm", *(["--per-task"] if per_task else []),
                         "--job-name", name, "--partition", partition, "--account", account,
                         "--mem", "8G", "--dry-run", "--", "--lr", "$(touch v)", script_arg)
        check = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
        assert check.returncode == 0, (name, check.stderr)
        path = tmp_path / "job.sbatch"
        path.write_text(script)
        record = tmp_path / "srun.args"
        env = h.base_env(PATH=f"{bindir}:{os.environ['PATH']}", SLURM_JOB_ID="42",
                         SRUN_ARGS=str(record))
        proc = subprocess.run(["bash", str(path)], cwd=work, env=env, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, (name, proc.stderr)
        argv = record.read_bytes().decode().split("\0")[:-1]
        assert argv[argv.index("--name") + 1] == f"{name}-42"
        assert argv[-3:] == ["--lr", "$(touch v)", script_arg]
        assert sorted(os.listdir(work)) == [], f"{name!r} ran something: {os.listdir(work)}"
        for old in (False, True):
            options = _directives(script, old)
            assert (options["job-name"], options["partition"], options["account"],
                    options["mem"]) == (name, partition, account, "8G"), (name, old)


def test_hostile_values_load_back_from_the_manifest(cli, h, tmp_path):
    yaml = pytest.importorskip("yaml")
    image, memory = 'reg.io/img:1 # "x" \\ y: {z}', "64Gi'\""
    text = _render(cli, h, tmp_path, "--k8s", "--nodes", "2", "--job-name", "ok-name",
                   "--namespace", "team-a", "--image", image, "--mem", memory, "--dry-run",
                   "--", "--lr", "$(touch v)", "train.py")
    job = yaml.safe_load(text)
    assert (job["metadata"]["name"], job["metadata"]["namespace"]) == ("ok-name", "team-a")
    for role in job["spec"]["pytorchReplicaSpecs"].values():
        (container,) = role["template"]["spec"]["containers"]
        assert container["image"] == image
        assert container["resources"]["limits"]["memory"] == memory
        assert container["command"][-3:] == ["--lr", "$(touch v)", "train.py"]


REFUSED = [
    (["--slurm", "--job-name", "a\nb"],
     "error: --job-name 'a\\nb' holds a control character (a newline, tab or escape); give it "
     "on one line, in printable characters"),
    (["--slurm", "--job-name", "run\x1b[2J"],
     "error: --job-name 'run\\x1b[2J' holds a control character (a newline, tab or escape); "
     "give it on one line, in printable characters"),
    (["--slurm", "--partition", "gpu\n#SBATCH --account=other"],
     "error: --partition 'gpu\\n#SBATCH --account=other' holds a control character (a "
     "newline, tab or escape); give it on one line, in printable characters"),
    (["--slurm", "--time", "1:00\r"],
     "error: --time '1:00\\r' holds a control character (a newline, tab or escape); give it "
     "on one line, in printable characters"),
    (["--k8s", "--image", "img\nkind: Pod"],
     "error: --image 'img\\nkind: Pod' holds a control character (a newline, tab or escape); "
     "give it on one line, in printable characters"),
    (["--k8s", "--namespace", "x\ny: z"],
     "error: --namespace 'x\\ny: z' holds a control character (a newline, tab or escape); "
     "give it on one line, in printable characters"),
    (["--k8s", "--namespace", "Team A"],
     "error: --namespace 'Team A' is not a Kubernetes name (lowercase letters, digits and "
     "'-')"),
    (["--slurm", "--job-name", ""],
     "error: --job-name is empty: give a name, or leave the flag out for the script's name"),
    (["--slurm", "--job-name", "../up"],
     "error: --job-name '../up' is also the run folder's name: no '/', '\\' or '..' (choose "
     "a plain name)"),
]


@pytest.mark.parametrize("args,line", REFUSED, ids=[f"{i}" for i in range(len(REFUSED))])
def test_values_no_job_file_can_carry_are_one_line(cli, h, tmp_path, args, line):
    out = tmp_path / "job.file"
    result = cli("submit", *args, "-o", str(out), "--", "train.py", env=h.cli_env(),
                 cwd=tmp_path)
    assert (result.returncode, result.stderr.splitlines()) == (2, [line]), result
    assert result.stdout == "" and "Traceback" not in result.output
    assert os.listdir(tmp_path) == []  # no job file, whole or half


def test_a_job_file_that_cannot_be_written_is_one_line_and_leaves_nothing(cli, h, tmp_path):
    target = Path("no-such-folder") / "job.sbatch"
    result = cli("submit", "--slurm", "-o", str(target), "--", "train.py", env=h.cli_env(),
                 cwd=tmp_path)
    assert (result.returncode, result.stderr.splitlines()) == (2, [
        "error: cannot write the job file no-such-folder/job.sbatch: No such file or "
        "directory (choose another -o path, or use --dry-run to print it)"]), result
    assert os.listdir(tmp_path) == []
