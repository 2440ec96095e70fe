"""Checkpoints on a folder every node shares, and on per-host disks (issue 27, item 6).

Two `distrun run` launchers on 127.0.0.1 are two nodes. Per-host disks: each launcher runs in
its own mount namespace (``unshare --mount``) where the checkpoint folder's path is a bind
mount of that "host's" own folder, so the two nodes write the same path and see different
files, as on two machines with local disks. The namespaces (and their mounts) end with the
launchers, which are killed at the end of every test.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from distrun._launch.folder_lock import LOCK_FILE
from distrun.testing import free_port

HERE = Path(__file__).resolve().parent
TASK = str(HERE / "st_task.py") + ":Task"
TRAIN = ["--strategy", "st_ddp", "--nproc-per-node", "1", "--batch-size", "8", "--max-steps",
         "4", "--ckpt-every-n-steps", "2", "--no-summary", "--timeout", "60"]
_SCHEDULER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_", "PET_")



def _saved(folder) -> list[str]:
    """What a run left in ``folder``, but the lock file of the run that held it (kept: a lock
    is freed by closing it, removing it would race the next run's)."""
    return sorted(n for n in os.listdir(folder) if n != LOCK_FILE)

def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"],
                           capture_output=True)
    return probe.returncode == 0


per_host_disks = pytest.mark.skipif(
    not _can_unshare(), reason="per-host disks need mount namespaces (unshare --mount: root or "
                               "CAP_SYS_ADMIN)")


def _env(plugins: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_SCHEDULER_PREFIXES)
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update({"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
                "DISTRUN_DISABLE_PLUGIN_AUTOLOAD": "1", "DISTRUN_PLUGINS": plugins,
                "OMP_NUM_THREADS": "1"})
    return env


class Node:
    """One launcher; with ``disk``, in a mount namespace where ``ckpt`` is that folder."""

    def __init__(self, tmp: Path, name: str, args: list[str], ckpt: Path, disk: Path | None,
                 plugins: str) -> None:
        command = [sys.executable, "-m", "distrun", "run", *args]
        if disk is not None:
            disk.mkdir(parents=True, exist_ok=True)
            command = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                       'mount --bind "$1" "$2" && shift 2 && exec "$@"', "sh", str(disk),
                       str(ckpt), *command]
        self.log = tmp / f"{name}.out"
        self._fh = open(self.log, "w")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(command, cwd=tmp, env=_env(plugins), stdout=self._fh,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, timeout: float = 240) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._fh.close()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=60)
        self._fh.close()


def _two_nodes(tmp: Path, per_node: list[list[str]], per_host: bool,
               plugins: str = "distrun_safetensors.plugin,st_plugin") -> tuple[list[int],
                                                                                list[str]]:
    ckpt = tmp / "ckpt"
    ckpt.mkdir(exist_ok=True)
    nodes = [Node(tmp, f"node{i}", [*args, "--ckpt-dir", str(ckpt), *TRAIN, TASK], ckpt,
                  tmp / f"disk{i}" if per_host else None, plugins)
             for i, args in enumerate(per_node)]
    try:
        codes = [node.wait() for node in nodes]
    finally:
        for node in nodes:
            node.kill()  # its workers and its mount namespace go with it
    return codes, [node.output() for node in nodes]


def _static(port: int) -> list[list[str]]:
    return [["--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1",
             "--master-port", str(port), "--name", "static"] for rank in (0, 1)]


def _refusal(ckpt: Path, node: int, other: int) -> str:
    host = os.uname().nodename
    return (f"error: the checkpoint folder {ckpt} is not shared by the nodes: node {node} (host "
            f"{host}) does not see the files node {other} (host {host}) writes there; ")


@per_host_disks
def test_a_static_run_on_per_host_disks_is_refused_in_one_line(tmp_path):
    codes, outputs = _two_nodes(tmp_path, _static(free_port()), per_host=True)
    assert codes == [2, 2], outputs
    for out in outputs:  # the same line on every node: what rank 0 found
        line = _refusal(tmp_path / "ckpt", 0, 1) + (
            "each checkpoint of a run on several nodes is written by all of them, so it needs "
            "one folder every node sees (a shared filesystem such as NFS: --ckpt-dir "
            "/shared/path)")
        assert out.count(line) == 1 and "Traceback" not in out, out
    for disk in ("disk0", "disk1"):  # nothing saved, and the markers were removed
        assert _saved(tmp_path / disk) == [], disk


@pytest.mark.slow
def test_a_static_run_on_a_shared_folder_saves_and_resumes(tmp_path):
    codes, outputs = _two_nodes(tmp_path, _static(free_port()), per_host=False)
    assert codes == [0, 0], outputs
    ckpt = tmp_path / "ckpt"
    assert _saved(ckpt) == [".generation", "latest", "step-2", "step-4"]
    again = [[*args, "--resume", "latest"] for args in _static(free_port())]
    codes, outputs = _two_nodes(tmp_path, again, per_host=False)
    assert codes == [0, 0], outputs
    assert "Resumed from" in outputs[0] and "at step 4" in outputs[0], outputs[0]


@pytest.mark.slow
@per_host_disks
def test_an_elastic_run_on_per_host_disks_is_refused_in_one_line(tmp_path):
    """Restarts with several nodes under the elastic agent: a lost host would take its shards
    with it, so the run stops at its start, whatever it was asked to save."""
    pytest.importorskip("distrun_elastic", reason="the elastic agent")
    port = free_port()
    common = ["--nnodes", "2", "--max-restarts", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
              "--rdzv-id", "perhost"]
    per_node = [[*common, "--rdzv-conf", f"is_host={host}"] for host in ("true", "false")]
    codes, outputs = _two_nodes(tmp_path, per_node, per_host=True,
                                plugins="distrun_elastic.plugin,distrun_safetensors.plugin,"
                                        "st_plugin")
    assert codes == [2, 2], outputs
    for out in outputs:
        assert out.count(_refusal(tmp_path / "ckpt", 0, 1)) == 1, out
        assert ("an elastic run on several nodes resumes on the hosts that remain, from "
                "checkpoints every node wrote, so it needs one folder every node sees (a shared "
                "filesystem such as NFS: --ckpt-dir /shared/path)") in out, out
        assert "restarting" not in out, out
    for disk in ("disk0", "disk1"):
        assert _saved(tmp_path / disk) == [], disk
