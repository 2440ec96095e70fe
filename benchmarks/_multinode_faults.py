"""One fault trial of ``benchmarks/multinode.py`` (see its docstring): launch, fault, measure."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from distrun.testing.hosts import Host, Testbed

HERE = Path(__file__).resolve().parent
PLAIN = HERE / "_multinode_plain.py"

SIDES = ("torchrun", "torchrun-fix", "distrun")
FAULTS = ("node-loss", "partition", "late-join")

#: the script's collective timeout, init_process_group(timeout=T), on both sides
T = 60
STEPS = 100
FAULT_STEP = 23  # the fault comes once a step >= this one is done at 2 ranks
CKPT_EVERY = 5
PACE = 0.2  # seconds of sleep per step: a bigger model's compute
MAX_RESTARTS = 3
#: torch rendezvous timings distrun derives from its default --heartbeat-timeout 15
#: (distrun_elastic.launch.rendezvous_defaults), given to both sides
RDZV_CONF = "keep_alive_interval=5,keep_alive_max_attempt=3,last_call_timeout=3,read_timeout=15"
ENDPOINT = "198.18.0.1:29400"
START_BOUND = 240.0  # seconds for the first two hosts to reach the fault step
HANG_BOUND = 3.0 * T  # seconds after the fault by which every launcher must have ended
ORPHAN_GRACE = 2.0


def fault_settings() -> str:
    return (f"{STEPS} steps of ~{PACE} s, checkpoint every {CKPT_EVERY}, collective timeout "
            f"T = {T} s, fault after step {FAULT_STEP} at 2 ranks, --max-restarts "
            f"{MAX_RESTARTS}, --rdzv-conf {RDZV_CONF} on every side, distrun's "
            f"--heartbeat-timeout 15 (default); a hang: a launcher still running "
            f"{HANG_BOUND:.0f} s after the fault")


@dataclass
class Trial:
    side: str
    fault: str
    recovered: bool = False
    recovery_s: float | None = None
    respawn_s: float | None = None  # the fault -> the first worker of the new world began
    lost: int | None = None
    hang: bool = False
    orphans: int = 0
    exits: str = ""  # each launcher's exit code (negative: the signal that ended it)
    note: str = ""

    def line(self) -> str:
        parts = ["recovered" if self.recovered else "NOT recovered"]
        if self.recovery_s is not None:
            parts.append(f"first step {self.recovery_s:.1f} s after the fault")
        if self.respawn_s is not None:
            parts.append(f"its worker began at {self.respawn_s:.1f} s")
        if self.lost is not None:
            parts.append(f"{self.lost} steps lost")
        if self.hang:
            parts.append("HANG")
        if self.orphans:
            parts.append(f"{self.orphans} ORPHANS")
        if self.exits:
            parts.append(f"exits {self.exits}")
        if self.note:
            parts.append(self.note)
        return ", ".join(parts)


def launch_env(side: str) -> dict[str, str]:
    """A clean environment for a launcher (no scheduler's or torchrun's variables)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_", "PET_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                         "GLOO_SOCKET_IFNAME", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if side == "torchrun-fix":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def _command(side: str, out: Path, rdzv_id: str) -> list[str]:
    flags = ["--nnodes", "1:3", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", ENDPOINT, "--rdzv-id", rdzv_id,
             "--max-restarts", str(MAX_RESTARTS), "--rdzv-conf", RDZV_CONF]
    worker = [str(PLAIN), "fault", str(out), str(STEPS), str(T), str(PACE), str(CKPT_EVERY)]
    launcher = ["torch.distributed.run"] if side.startswith("torchrun") else ["distrun", "run"]
    return [sys.executable, "-m", *launcher, *flags, *worker]


def _start(host: Host, side: str, out: Path, rdzv_id: str) -> subprocess.Popen:
    with open(out / f"{host.name}.log", "w") as log:
        return host.popen(_command(side, out, rdzv_id), env=launch_env(side), cwd=out, stdout=log,
                          stderr=subprocess.STDOUT)


def _records(out: Path) -> list[dict]:
    recs = []
    for path in (out / "rec").glob("*.jsonl") if (out / "rec").is_dir() else ():
        for line in path.read_text().splitlines():
            try:
                recs.append(json.loads(line))
            except ValueError:
                pass  # a line being written
    return recs


def _reached_fault_step(out: Path) -> bool:
    return any(r["event"] == "step" and r["world"] == 2 and r["step"] >= FAULT_STEP
               for r in _records(out))


def run_trial(side: str, fault: str, index: int, work: Path) -> Trial:
    """One trial on a fresh testbed; the testbed and everything on it are gone afterwards."""
    out = work / f"{fault}-{side}-{index}"
    out.mkdir()
    trial = Trial(side, fault)
    with Testbed.up(3 if fault == "late-join" else 2) as bed:
        rdzv_id = f"mn{index}"
        procs = [_start(bed[0], side, out, rdzv_id), _start(bed[1], side, out, rdzv_id)]
        deadline = time.monotonic() + START_BOUND
        while not _reached_fault_step(out):
            ended = [p for p in procs if p.poll() is not None]
            if ended or time.monotonic() > deadline:
                trial.note = (f"ended (exit {ended[0].returncode}) before the fault" if ended
                              else f"did not reach step {FAULT_STEP} at 2 ranks in "
                                   f"{START_BOUND:.0f} s")
                return _finish(trial, bed, procs, out)
            time.sleep(0.1)
        fault_at = time.time()
        (out / "fault.json").write_text(json.dumps({"fault": fault, "t": fault_at}))
        if fault == "node-loss":
            bed[1].kill_all()
        elif fault == "partition":
            bed[1].cut()
        else:
            procs.append(_start(bed[2], side, out, rdzv_id))
        until = time.monotonic() + HANG_BOUND
        while any(p.poll() is None for p in procs) and time.monotonic() < until:
            time.sleep(0.2)
        hung = [(h, p) for h, p in zip(bed, procs) if p.poll() is None]
        trial.hang = bool(hung)
        for host, proc in hung:
            _evidence(host, proc.pid, out / f"hang-{host.name}.txt")
            trial.note = ", ".join(filter(None, [trial.note, f"{host.name} hung"]))
            proc.kill()
            proc.wait()
        if fault == "partition":
            bed[1].restore()
        _measure(trial, out, fault_at, procs)
        return _finish(trial, bed, procs, out)


def _evidence(host: Host, pid: int, path: Path) -> None:
    """Where a hung launcher waits: its Python threads' stacks (where py-spy is installed), its
    threads' kernel wait channels and the host's TCP sockets (with their retransmissions)."""
    lines = []
    if shutil.which("py-spy"):
        lines.append(subprocess.run(["py-spy", "dump", "--pid", str(pid)], capture_output=True,
                                    text=True, timeout=60).stdout)
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        try:
            lines.append(f"thread {task.name} {(task / 'comm').read_text().strip()}: "
                         f"{(task / 'wchan').read_text().strip()}")
        except OSError:
            pass
    lines.append(host.run(["ss", "-tnpoi"]).stdout)
    path.write_text("\n".join(lines))


def _finish(trial: Trial, bed: Testbed, procs: list[subprocess.Popen], out: Path) -> Trial:
    for proc in procs:  # a trial that ended early: stop the rest
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    time.sleep(ORPHAN_GRACE)
    left = [(h.name, pid) for h in bed for pid in h.pids()]
    trial.orphans = len(left)
    if left:
        names = []
        for host, pid in left:
            try:
                names.append(f"{host}:{Path(f'/proc/{pid}/comm').read_text().strip()}")
            except OSError:
                names.append(f"{host}:{pid}")
        trial.note = ", ".join(filter(None, [trial.note, "left: " + " ".join(names)]))
    if not trial.recovered:
        trial.note = ", ".join(filter(None, [trial.note, _why(out)]))
    return trial


def _why(out: Path) -> str:
    """The host0 launcher's last error line, briefly."""
    log = out / "host0.log"
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    said = [ln for ln in lines if "Error" in ln or ln.startswith("distrun:")]
    return f"host0: {said[-1].strip()[:150]}" if said else ""


def _measure(trial: Trial, out: Path, fault_at: float, procs: list[subprocess.Popen]) -> None:
    recs = _records(out)
    world = 3 if trial.fault == "late-join" else 1
    after = [r for r in recs if r["t"] > fault_at and r["world"] == world]
    steps_after = [r for r in after if r["event"] == "step"]
    starts_after = [r for r in after if r["event"] == "start"]
    if steps_after:
        trial.recovery_s = min(r["t"] for r in steps_after) - fault_at
    if starts_after:
        resumed = min(r["resumed_from"] for r in starts_after)
        reformed = min(r["born"] for r in starts_after)
        trial.respawn_s = reformed - fault_at
        # the last step each rank of the old world finished (before the fault, and so before
        # the new world began; after a join the old world trains on until its agents stop it)
        last: dict[int, int] = {}
        for r in recs:
            if r["event"] == "step" and r["world"] == 2 and r["t"] <= reformed:
                last[r["rank"]] = max(last.get(r["rank"], 0), r["step"])
        trial.lost = sum(step - resumed for step in last.values())
    # who must finish: host0 (the survivor) after a loss or a cut; every host after a join
    must = procs if trial.fault == "late-join" else procs[:1]
    done = any(r["event"] == "step" and r["step"] == STEPS and r["world"] == world
               for r in steps_after)
    trial.recovered = bool(steps_after) and done and all(p.returncode == 0 for p in must)
    trial.exits = " ".join(f"host{k}:{p.returncode}" for k, p in enumerate(procs))
