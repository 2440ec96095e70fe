"""Static multi-node runs on real network hosts (distrun.testing.hosts: namespaces, own names).

One ``distrun run --nnodes 2 --node-rank R --master-addr 198.18.0.1`` launcher per host, as on
two machines, the run folder on storage both hosts see. Checked against one host:

- 2 hosts x 2 processes train digits and tiny_gpt under ddp, fsdp and tp (4-way across the
  hosts on digits; 2-way inside each host under fsdp across them on tiny_gpt) to the same
  losses and the same checkpoint tensors as 1 host x 4 processes (same seed, same global
  batch). The ranks and the reduction order are the same, so the tolerance is zero: bit for
  bit. The fast lane keeps digits under ddp.
- a host whose own name resolves to 127.0.1.1 (the classic hang at init) runs: it announces its
  address toward rank 0's host, or ``--local-addr`` (static and c10d rendezvous);
- every listening socket of a run, in every host, is on that host's address or its loopback,
  never on every interface (static and c10d rendezvous);
- the device-map backend forms (``cpu:gloo``; ``cpu:gloo,cuda:nccl`` where torch has NCCL and a
  GPU) work across hosts as gloo does.
"""

from __future__ import annotations

import csv
import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distrun.testing import HostSpec, run_cli

pytestmark = pytest.mark.multihost

ROOT = Path(__file__).resolve().parents[2]
DIGITS = str(ROOT / "examples" / "digits.py")
GPT = str(ROOT / "examples" / "tiny_gpt.py")
TINY = "tests.core.tiny_task:TinyTask"
#: any port does (each testbed has its own), but not one a run just used: its connections wait
#: in TIME_WAIT there for a minute, and the launcher's port check (a bind without
#: SO_REUSEADDR) takes that for "in use"
PORTS = itertools.count(29500)
GPT_ENV = {"TINY_GPT_DIM": "32", "TINY_GPT_LAYERS": "2", "TINY_GPT_CHARS": "20000"}
#: case -> (script, strategy flags, environment); digits-ddp is the fast lane's
CASES = {
    "digits-ddp": (DIGITS, ["--strategy", "ddp"], {}),
    "digits-fsdp": (DIGITS, ["--strategy", "fsdp"], {}),
    "digits-tp": (DIGITS, ["--strategy", "tp"], {}),
    "gpt-ddp": (GPT, ["--strategy", "ddp", "--batch-size", "8"], GPT_ENV),
    "gpt-fsdp": (GPT, ["--strategy", "fsdp", "--batch-size", "8"], GPT_ENV),
    # the usual layout: tensor parallel inside a host, fsdp across the hosts (digits-tp has
    # tensor parallel across them)
    "gpt-fsdp-tp2": (GPT, ["--strategy", "fsdp", "--tp-size", "2", "--batch-size", "8"],
                     GPT_ENV),
}
COMMON = ["--max-steps", "3", "--log-every-n-steps", "1", "--seed", "11",
          "--ckpt-save-on-end", "--timeout", "120"]


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The test's environment without any scheduler's or torchrun's variables."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_", "PET_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                         "GLOO_SOCKET_IFNAME")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **(extra or {}))
    return env


def _launch(bed, args: list[list[str]], cwd: Path, env: dict[str, str] | None = None,
            timeout: float = 300) -> list[tuple[int, str]]:
    """``distrun run ARGS[K]`` on each host K at once; (exit code, output) of each."""
    logs = [cwd / f"node{h.index}.log" for h in bed]
    procs = []
    for host, log in zip(bed, logs):
        with open(log, "w") as fh:
            procs.append(host.popen([sys.executable, "-m", "distrun", "run", *args[host.index]],
                                    env=_env(env), cwd=cwd, stdout=fh, stderr=subprocess.STDOUT))
    codes = [p.wait(timeout=timeout) for p in procs]
    return [(c, log.read_text()) for c, log in zip(codes, logs)]


def _static(bed, nproc: int, master: str = "198.18.0.1"):
    """The static flags of each host (a fresh master port for each call)."""
    port = str(next(PORTS))
    return lambda host: ["--nnodes", str(len(bed)), "--node-rank", str(host.index),
                         "--nproc-per-node", str(nproc), "--master-addr", master,
                         "--master-port", port]


def _results(run_dir: Path) -> tuple[list[dict], dict]:
    from safetensors.torch import load_file

    with open(run_dir / "metrics.csv") as fh:
        rows = [{k: row[k] for k in ("step", "loss", "val_loss")} for row in csv.DictReader(fh)]
    step = run_dir / "checkpoints" / "step-3"
    tensors = {f"{p.name}:{k}": v for p in sorted(step.glob("*.safetensors"))
               for k, v in load_file(str(p)).items()}
    assert rows and tensors, f"no metrics or checkpoint in {run_dir}"
    return rows, tensors


def _same_training_on_two_hosts(bed, tmp_path: Path, case: str) -> None:
    script, flags, env = CASES[case]
    one = run_cli("run", "--nproc-per-node", "4", *flags, *COMMON, "--run-dir",
                  str(tmp_path / "one"), script, env=_env(env), cwd=tmp_path, timeout=300)
    assert one.returncode == 0, one
    run_dir = tmp_path / "two"  # one folder on storage both hosts see
    static = _static(bed, 2)
    args = [[*static(h), *flags, *COMMON, "--run-dir", str(run_dir), script] for h in bed]
    for code, out in _launch(bed, args, tmp_path, env):
        assert code == 0, out
    want_rows, want = _results(tmp_path / "one")
    rows, got = _results(run_dir)
    assert rows == want_rows  # loss and val_loss of every step, as metrics.csv writes them
    assert sorted(got) == sorted(want)  # the same shard files: ranks 0-3 wrote them
    import torch

    for key, value in want.items():
        assert torch.equal(got[key], value), f"{case}: {key} differs on two hosts"


def test_two_hosts_train_digits_with_ddp_as_one_host_does(distrun_hosts, tmp_path):
    _same_training_on_two_hosts(distrun_hosts(2), tmp_path, "digits-ddp")


#: the cells the default suite runs (digits-ddp has its own test); the others are `extended`
DEFAULT_CASES = ("gpt-fsdp-tp2",)


@pytest.mark.slow
@pytest.mark.parametrize("case", [
    pytest.param(c, marks=() if c in DEFAULT_CASES else pytest.mark.extended)
    for c in CASES if c != "digits-ddp"])
def test_two_hosts_train_as_one_host_does(distrun_hosts, tmp_path, case):
    _same_training_on_two_hosts(distrun_hosts(2), tmp_path, case)


SUM = """
import datetime, socket
import torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
t = torch.tensor([float(dist.get_rank())])
dist.all_reduce(t)
print("sum", t.item(), "on", socket.gethostname())
dist.destroy_process_group()
"""


def test_a_host_named_after_loopback_runs_without_local_addr(distrun_hosts, tmp_path):
    """Its gloo would announce 127.0.1.1 and the other node would wait for it until the
    timeout (the classic hang at init): distrun announces the address that reaches rank 0's
    host instead. A --local-addr that is not this host's is one line."""
    bed = distrun_hosts([HostSpec(), HostSpec(own_name="loopback")])
    (tmp_path / "sum.py").write_text(SUM)
    static = _static(bed, 1)
    for code, out in _launch(bed, [[*static(h), "sum.py"] for h in bed], tmp_path,
                             timeout=240):
        assert code == 0, out
        assert "sum 1.0 on" in out, out
    bad = bed[1].run([sys.executable, "-m", "distrun", "run", *static(bed[1]), "--local-addr",
                      "198.18.0.1", "sum.py"], env=_env(), cwd=tmp_path, timeout=120)
    assert bad.returncode == 2 and bad.stderr.splitlines() == [
        "error: --local-addr 198.18.0.1: it is not an address of this host (its addresses: "
        "127.0.0.1 (lo), 198.18.0.2 (eth0))"]


@pytest.mark.slow
@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_a_host_named_after_loopback_runs_with_local_addr(distrun_hosts, tmp_path, rendezvous):
    bed = distrun_hosts([HostSpec(), HostSpec(own_name="loopback")])
    (tmp_path / "sum.py").write_text(SUM)

    static = _static(bed, 1)
    c10d = ["--nnodes", "2", "--rdzv-endpoint", "198.18.0.1:29400", "--rdzv-id", "j"]
    args = [[*(static(h) if rendezvous == "static" else c10d), "--local-addr", h.address,
             "sum.py"] for h in bed]
    results = _launch(bed, args, tmp_path, timeout=240)
    for (code, out), host in zip(results, bed):
        assert code == 0, out
        assert f"sum 1.0 on {host.name}" in out.splitlines()


def _nccl() -> str | None:
    """Why NCCL cannot run here, or None."""
    import torch

    if not (torch.cuda.is_available() and torch.distributed.is_nccl_available()):
        return "cpu:gloo,cuda:nccl needs a CUDA build of torch with NCCL and a GPU"
    return None


@pytest.mark.slow
@pytest.mark.parametrize("device_map", ["cpu:gloo", pytest.param(
    "cpu:gloo,cuda:nccl", marks=pytest.mark.skipif(_nccl() is not None, reason=str(_nccl())))])
def test_a_device_map_backend_works_across_hosts_as_gloo_does(distrun_hosts, tmp_path,
                                                              device_map):
    bed = distrun_hosts(2)
    losses = {}
    for backend in ("gloo", device_map):
        run_dir = tmp_path / backend.replace(":", "-").replace(",", "_")
        static = _static(bed, 1)
        # on the CPU: a cuda entry of the map is carried, not used
        args = [[*static(h), "--device", "cpu", "--backend", backend, "--strategy", "ddp",
                 "--max-steps", "4", "--log-every-n-steps", "1", "--batch-size", "16",
                 "--run-dir", str(run_dir), TINY] for h in bed]
        for code, out in _launch(bed, args, tmp_path, timeout=240):
            assert code == 0, out
        with open(run_dir / "metrics.csv") as fh:
            losses[backend] = [row["loss"] for row in csv.DictReader(fh) if row["loss"]]
    assert len(losses["gloo"]) == 4 and losses[device_map] == losses["gloo"]


PAUSE = """
import datetime, os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
t = torch.ones(1)
dist.all_reduce(t)
open(os.path.join(sys.argv[1], f"up{dist.get_rank()}"), "w").close()
while not os.path.exists(os.path.join(sys.argv[1], "done")):
    time.sleep(0.1)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.parametrize("rendezvous", ["static", pytest.param("c10d", marks=pytest.mark.slow)])
def test_every_server_of_a_multihost_run_listens_on_its_hosts_address(distrun_hosts, tmp_path,
                                                                      rendezvous):
    """`ss -ltnp` in each host while a 2 x 2 run holds its sockets: the store, the elastic
    rendezvous and attempt stores, gloo's pairs all on 198.18.0.K (or the loopback), none on
    every interface. Host 1 also has a second network (198.19.0.0/24) that nothing may use."""
    bed = distrun_hosts([HostSpec(), HostSpec(second_net=True)])
    (tmp_path / "pause.py").write_text(PAUSE)
    static = _static(bed, 2)
    c10d = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", "198.18.0.1:29400",
            "--rdzv-id", "j", "--max-restarts", "1"]
    logs, procs = [], []
    for host in bed:
        args = [*(static(host) if rendezvous == "static" else c10d), "pause.py", str(tmp_path)]
        logs.append(tmp_path / f"node{host.index}.log")
        with open(logs[-1], "w") as fh:
            procs.append(host.popen([sys.executable, "-m", "distrun", "run", *args],
                                    env=_env(), cwd=tmp_path, stdout=fh,
                                    stderr=subprocess.STDOUT))
    try:
        deadline = time.monotonic() + 180
        while not all((tmp_path / f"up{r}").exists() for r in range(4)):
            for proc, log in zip(procs, logs):
                assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the run did not start"
            time.sleep(0.2)
        seen = {host.index: host.listening() for host in bed}
    finally:
        (tmp_path / "done").touch()
    for proc, log in zip(procs, logs):
        assert proc.wait(timeout=120) == 0, log.read_text()
    for host in bed:
        ours = [s for s in seen[host.index] if s.processes]
        assert ours, f"{host.name}: no listening socket seen"
        wrong = [s for s in ours if s.address not in (host.address, "127.0.0.1", "::1")]
        assert not wrong, f"{host.name} listens beyond {host.address}: {wrong}"
