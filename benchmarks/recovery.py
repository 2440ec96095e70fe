"""Recovery: time from a worker's death to the first step of the resumed run.

    python benchmarks/recovery.py            # 5 trials of each side
    python benchmarks/recovery.py --quick    # 1 trial of each side
    python benchmarks/recovery.py --trials 10

Every side trains a tiny MLP on 2 processes with gloo on this machine; in the first attempt
rank 1 SIGKILLs itself at step KILL after writing the time. Each side is allowed one restart:

- ``torchrun``: plain ``torchrun --standalone --max-restarts 1`` restarting a plain torch
  script (no distrun) that saves a ``torch.save`` checkpoint every 2 steps and resumes from it.
  torch's default shares the rendezvous store with the workers, and restarted workers may then
  fail to connect (pytorch#167288);
- ``torchrun-fix``: the same with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, the setting
  distrun-elastic uses: torch's restart time when restarts work;
- ``distrun-run``: the same plain script under ``distrun run --max-restarts 1``: distrun's
  launcher against torchrun's on the same script. Its workers are forked from a warm spare per
  local rank that has imported torch already (target: at most 0.5x ``torchrun-fix``);
- ``distrun-run-cold``: the same with ``--no-warm-restart``: every start a new interpreter, as
  torchrun's (target: no slower than ``torchrun-fix``);
- ``distrun``: ``distrun run --max-restarts 1`` with distrun-elastic and distrun-safetensors
  running distrun's own loop, checkpointing every 2 steps; the restarted workers resume from the
  latest checkpoint (warm);
- ``distrun-cold``: the same with ``--no-warm-restart``;
- ``distrun-memory``: ``distrun`` with the memory tier as well (``--ckpt-memory-every-n-steps
  1``): the restarted workers load the newest checkpoint from the node's memory, not the disk.

The model, the kill step, the run's length, the checkpoint cadence and the process-group
timeout are read from ``BENCH_WIDTH`` and ``BENCH_DEPTH`` (an MLP 8 -> width, then ``depth``
width x width layers, -> 1; default 16 and 0), ``BENCH_KILL_STEP``, ``BENCH_STEPS``,
``BENCH_CKPT_EVERY`` and ``BENCH_PG_TIMEOUT`` (default 50, 60, 2 and 30 s) by every side, so
that ``benchmarks/curves.py`` can time the same restart for larger models.

Printed: per side, the medians over its successful trials (trials alternate side by side) of
the recovery (death -> end of the first step after it) and its two parts: detect+respawn
(death -> the restarted rank 0 process exists) and worker start -> first resumed step (the
interpreter, imports, process group, model and checkpoint load, one step); the most steps
redone in a trial (the steps the killed attempt finished that its restart trained again: the
disk cadence decides them for the disk sides, the memory tier takes them to at most one;
``BENCH_CKPT_EVERY=10 BENCH_KILL_STEP=47`` shows the difference); the checkpoint load time of
distrun's loop; the ratios of distrun-run and distrun-run-cold to each torchrun side
(the same script), the ratio distrun / (torchrun + load) (target <= 1; against torchrun-fix as
well, since plain torchrun may not succeed at all) and each side's success rate.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KILL_STEP = 50
STEPS = 60
CKPT_EVERY = 2
PG_TIMEOUT = 30

#: the wall-clock time this process was started (forked), from /proc: its age is the machine's
#: uptime minus the process's start time in clock ticks since boot (both 10 ms resolution)
STARTED = '''
def _started():
    with open("/proc/self/stat") as fh:
        ticks = int(fh.read().rpartition(")")[2].split()[19])
    with open("/proc/uptime") as fh:
        uptime = float(fh.read().split()[0])
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
'''

#: every side's model (torch.nn passed in): 8 -> width (-> width, depth times) -> 1
NET = '''
def _net(nn):
    width = int(os.environ.get("BENCH_WIDTH", "16"))
    layers = [nn.Linear(8, width), nn.Tanh()]
    for _ in range(int(os.environ.get("BENCH_DEPTH", "0"))):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 1))
'''

PLAIN_SCRIPT = '''
import datetime, json, os, signal, sys, time
STARTED
NET
import torch, torch.distributed as dist
from torch import nn

rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
out = sys.argv[1]
STEPS = int(os.environ.get("BENCH_STEPS", "DEFAULT_STEPS"))
KILL_STEP = int(os.environ.get("BENCH_KILL_STEP", "DEFAULT_KILL_STEP"))
EVERY = int(os.environ.get("BENCH_CKPT_EVERY", "DEFAULT_EVERY"))
timeout = int(os.environ.get("BENCH_PG_TIMEOUT", "DEFAULT_TIMEOUT"))
ckpt = os.path.join(out, "ckpt.pt")
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
torch.manual_seed(0)
model = _net(nn)
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
first = 1
if os.path.exists(ckpt):
    state = torch.load(ckpt)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    first = state["step"] + 1
    del state  # the optimizer holds its loaded tensors; the model's copy can go
x, y = torch.randn(256, 8), torch.randn(256, 1)
for step in range(first, STEPS + 1):
    i = step % 31
    loss = nn.functional.mse_loss(model(x[i * 8:(i + 1) * 8]), y[i * 8:(i + 1) * 8])
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
    opt.zero_grad()
    if rank == 0:
        with open(os.path.join(out, "steps.jsonl"), "a") as fh:
            fh.write(json.dumps({"attempt": attempt, "step": step, "t": time.time()}) + "\\n")
        if attempt > 0 and step == first:
            with open(os.path.join(out, "start.json"), "w") as fh:
                json.dump({"started": _started()}, fh)
        if step % EVERY == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step},
                       ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
    if attempt == 0 and rank == 1 and step == KILL_STEP:
        dist.barrier()  # rank 0's checkpoint of this step is written
        with open(os.path.join(out, "death.json"), "w") as fh:
            json.dump({"t": time.time()}, fh)
        os.kill(os.getpid(), signal.SIGKILL)
    elif attempt == 0 and step == KILL_STEP:
        dist.barrier()
dist.destroy_process_group()
'''.replace("DEFAULT_STEPS", str(STEPS)).replace(
    "DEFAULT_KILL_STEP", str(KILL_STEP)).replace("DEFAULT_EVERY", str(CKPT_EVERY)).replace(
    "DEFAULT_TIMEOUT", str(PG_TIMEOUT)).replace("STARTED\n", STARTED).replace("NET\n", NET)

PLUGIN = '''
"""Benchmark helper plugin: a gradient-averaging strategy, the kill and the timestamps."""
import json, os, signal, time
from distrun.plugin import StrategyInfo, hookimpl

KILL_STEP = int(os.environ.get("BENCH_KILL_STEP", "DEFAULT_KILL_STEP"))


def _make(config):
    import torch.distributed as dist
    from distrun.plugin import BaseStrategy

    class GradSum(BaseStrategy):
        name = "benchsum"

        def optimizer_step(self, optimizer):
            if self.distributed:
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            dist.all_reduce(p.grad)
            optimizer.step()

    return GradSum(config)


@hookimpl
def distrun_register_strategies(register):
    register(StrategyInfo("benchsum", _make, plugin="recovery_bench"))


def _out(name, record):
    with open(os.path.join(os.environ["BENCH_OUT"], name), "a") as fh:
        fh.write(json.dumps(record) + "\\n")


@hookimpl(wrapper=True)
def distrun_load_checkpoint(run, source):
    start = time.perf_counter()
    path = yield
    if run.rank == 0 and path:
        _out("load.jsonl", {"seconds": time.perf_counter() - start})
    return path


_first = []


@hookimpl(trylast=True)
def distrun_on_step_end(run, step):
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if run.rank == 0:
        _out("steps.jsonl", {"attempt": attempt, "step": step, "t": time.time()})
        if attempt > 0 and not _first:
            _first.append(step)
            with open(os.path.join(os.environ["BENCH_OUT"], "start.json"), "w") as fh:
                json.dump({"started": _started()}, fh)
    if attempt == 0 and run.rank == 1 and step == KILL_STEP:
        with open(os.path.join(os.environ["BENCH_OUT"], "death.json"), "w") as fh:
            json.dump({"t": time.time()}, fh)
        os.kill(os.getpid(), signal.SIGKILL)
STARTED'''.replace("DEFAULT_KILL_STEP", str(KILL_STEP)).replace("STARTED", STARTED)

TASK = '''
import os
import torch
from torch import nn
import distrun
NET

class BenchTask(distrun.Task):
    def __init__(self):
        gen = torch.Generator().manual_seed(0)
        self.data = torch.utils.data.TensorDataset(torch.randn(256, 8, generator=gen),
                                                   torch.randn(256, 1, generator=gen))

    def configure_model(self):
        return _net(nn)

    def configure_optimizer(self, params):
        return torch.optim.AdamW(params, lr=0.01)

    def train_data(self):
        return self.data

    def training_step(self, model, batch):
        x, y = batch
        return nn.functional.mse_loss(model(x), y)
'''.replace("NET", NET)


#: one trial: (success, recovery s, detect+respawn s, worker start -> first step s, load s,
#: steps redone)
Trial = tuple[bool, float | None, float | None, float | None, float | None, int | None]


def _recovery(out: Path) -> tuple[float | None, float | None, float | None]:
    """Seconds from the death to the end of the first step trained after it, and its parts."""
    try:
        death = json.loads((out / "death.json").read_text())["t"]
    except FileNotFoundError:
        return None, None, None
    steps = [json.loads(ln) for ln in (out / "steps.jsonl").read_text().splitlines()]
    after = [s["t"] for s in steps if s["attempt"] > 0 and s["t"] > death]
    if not after:
        return None, None, None
    try:
        started = json.loads((out / "start.json").read_text())["started"]
    except FileNotFoundError:
        return min(after) - death, None, None
    return min(after) - death, started - death, min(after) - started


def redone(out: Path) -> int | None:
    """The steps trained twice: from the first step after the restart to the last one the
    killed attempt finished (rank 0's record)."""
    try:
        steps = [json.loads(ln) for ln in (out / "steps.jsonl").read_text().splitlines()]
    except FileNotFoundError:
        return None
    before = [s["step"] for s in steps if s["attempt"] == 0]
    after = [s["step"] for s in steps if s["attempt"] > 0]
    return max(before) - min(after) + 1 if before and after else None


def prepare(work: Path) -> None:
    """Write the sides' script, plugin and task into ``work`` (what :func:`trial` runs)."""
    (work / "plain.py").write_text(PLAIN_SCRIPT)
    (work / "recovery_bench.py").write_text(PLUGIN)
    (work / "bench_task.py").write_text(TASK)


def trial(kind: str, work: Path, index: int, extra_env: dict[str, str] | None = None,
           timeout: float = 300) -> Trial:
    """One launch of side ``kind`` in ``work/<kind>-<index>``; ``extra_env``: the ``BENCH_*``
    settings of the module docstring."""
    out = work / f"{kind}-{index}"
    out.mkdir()
    # work first (the plugin and task modules), then what the caller's path had
    path = os.pathsep.join(p for p in (str(work), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", BENCH_OUT=str(out), PYTHONPATH=path,
               **(extra_env or {}))
    plain = [str(work / "plain.py"), str(out)]
    if kind.startswith("torchrun"):
        if kind == "torchrun-fix":
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "--max-restarts", "1", *plain]
    elif kind.startswith("distrun-run"):  # the same script, distrun's launcher
        cmd = [sys.executable, "-m", "distrun", "run", "--max-restarts", "1",
               "--nproc-per-node", "2", *(["--no-warm-restart"] if "cold" in kind else []),
               *plain]
    else:
        env.update(DISTRUN_DISABLE_PLUGIN_AUTOLOAD="1",
                   DISTRUN_PLUGINS="distrun_elastic.plugin,distrun_safetensors.plugin,"
                                   "recovery_bench")
        cmd = [sys.executable, "-m", "distrun", "run", "--max-restarts", "1",
               "--nproc-per-node", "2", "--strategy", "benchsum", "--batch-size", "16",
               "--max-steps", env.get("BENCH_STEPS", str(STEPS)), "--max-epochs", "10",
               "--ckpt-every-n-steps", env.get("BENCH_CKPT_EVERY", str(CKPT_EVERY)),
               "--no-summary", "--timeout", env.get("BENCH_PG_TIMEOUT", str(PG_TIMEOUT)),
               "--name", f"bench-{index}",
               *(["--no-warm-restart"] if "cold" in kind else []),
               *(["--ckpt-memory-every-n-steps", "1"] if kind == "distrun-memory" else []),
               f"{work / 'bench_task.py'}:BenchTask"]
    try:
        proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True,
                              timeout=timeout)
        ok = proc.returncode == 0
        if not ok:  # say why, briefly
            lines = [ln for ln in proc.stderr.splitlines()
                     if "Error:" in ln and "traceback" not in ln]
            print(f"    {kind} exit {proc.returncode}: {(lines or ['?'])[-1][:160]}", flush=True)
    except subprocess.TimeoutExpired:
        ok = False
    load = None
    if (out / "load.jsonl").exists():
        load = json.loads((out / "load.jsonl").read_text().splitlines()[-1])["seconds"]
    rec, respawn, start = _recovery(out) if ok else (None, None, None)
    return ok, rec, respawn, start, load, redone(out) if ok else None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 trial of each side")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--sides", default=",".join(SIDES),
                        help=f"comma-separated sides to run (default: {','.join(SIDES)})")
    args = parser.parse_args(argv)
    trials = 1 if args.quick else args.trials
    sides = [k for k in args.sides.split(",") if k]
    unknown = set(sides) - set(SIDES)
    if unknown:
        parser.error(f"unknown side(s) {', '.join(sorted(unknown))}: choose from {SIDES}")
    work = Path(tempfile.mkdtemp(prefix="distrun-recovery-"))
    try:
        prepare(work)
        results: dict[str, list[Trial]] = {kind: [] for kind in sides}
        for i in range(trials):
            # interleaved and rotated, so every side sees the same machine load and none
            # always follows the same one
            for kind in sides[i % len(sides):] + sides[:i % len(sides)]:
                started = time.perf_counter()
                results[kind].append(trial(kind, work, i))
                ok, rec, respawn, start, _, again = results[kind][-1]
                parts = (f" (detect+respawn {respawn:.2f} s, start -> step {start:.2f} s)"
                         if respawn is not None and start is not None else "")
                print(f"  trial {i + 1}/{trials} {kind:<16}: "
                      f"{'ok' if ok else 'FAILED'}"
                      f"{f', recovery {rec:.2f} s' if rec is not None else ''}{parts}"
                      f"{f', {again} step(s) redone' if again is not None else ''}"
                      f" ({time.perf_counter() - started:.0f} s)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return _summary(results, trials)


#: every side, in the order they run
SIDES = ("torchrun", "torchrun-fix", "distrun-run", "distrun-run-cold", "distrun",
         "distrun-cold", "distrun-memory")


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _most(values: list[int | None]) -> str:
    """The largest count of steps redone of the trials ("n/a" without any)."""
    present = [v for v in values if v is not None]
    return str(max(present)) if present else "n/a"


def _summary(results: dict[str, list[Trial]], trials: int) -> int:
    def show(value: float | None) -> str:
        return f"{value:.2f} s" if value is not None else "n/a"

    med = {}
    print(f"medians of the successful trials: {'side':<16} {'recovery':>9} "
          f"{'detect+respawn':>15} {'start -> step':>14} {'redone':>7}  success")
    for kind, rows in results.items():
        good = [r for r in rows if r[0]]
        med[kind] = median([r[1] for r in good])
        rate = len(good)
        print(f"{'':34}{kind:<16} {show(med[kind]):>9} {show(median([r[2] for r in good])):>15} "
              f"{show(median([r[3] for r in good])):>14} "
              f"{_most([r[5] for r in good]):>7}  {rate}/{trials} "
              f"({100 * rate / trials:.0f}%)")
    for side, target in (("distrun-run", "0.50"), ("distrun-run-cold", "1.00")):
        for base in ("torchrun", "torchrun-fix"):
            if med.get(base) and med.get(side):
                print(f"ratio {side} / {base} (the same script): "
                      f"{med[side] / med[base]:.2f}  (target <= {target})")
    for side in ("distrun", "distrun-cold", "distrun-memory"):
        if side not in results:
            continue
        load = median([r[4] for r in results[side]]) or 0.0
        print(f"{side} checkpoint load (median): {load:.3f} s")
        for base in ("torchrun", "torchrun-fix"):
            if med.get(base) and med[side]:
                ratio = med[side] / (med[base] + load)
                print(f"ratio {side} / ({base} + load): {ratio:.2f}  (target <= 1.00)")
            elif base in med:
                print(f"ratio {side} / ({base} + load): n/a (no successful trial on one side)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
