"""Recovery: time from a worker's death to the first step of the resumed run.

    python benchmarks/recovery.py            # 2 trials of each side
    python benchmarks/recovery.py --quick    # 1 trial of each side
    python benchmarks/recovery.py --trials 10

Both sides train the same tiny MLP on 2 processes with gloo on this machine; in the first
attempt rank 1 SIGKILLs itself at step 6 after writing the time. Each side is allowed one
restart:

- ``torchrun``: plain ``torchrun --standalone --max-restarts 1`` restarting a plain torch
  script (no distrun), which starts over from step 1. torch's default shares the rendezvous
  store with the workers, and restarted workers may then fail to connect (pytorch#167288);
- ``torchrun-fix``: the same with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, the setting
  distrun-elastic uses: torch's restart time when restarts work;
- ``distrun``: ``distrun run --max-restarts 1`` with distrun-elastic and distrun-safetensors,
  checkpointing every 2 steps; the restarted workers resume from the step-4 checkpoint.

Printed: the median recovery of each side over its successful trials, the checkpoint load
time, the ratio distrun / (torchrun + load) (target <= 1; against torchrun-fix as well, since
plain torchrun may not succeed at all) and each side's success rate.
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

KILL_STEP = 6
STEPS = 12

PLAIN_SCRIPT = '''
import datetime, json, os, signal, sys, time
import torch, torch.distributed as dist
from torch import nn

rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
out = sys.argv[1]
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
x, y = torch.randn(256, 8), torch.randn(256, 1)
for step in range(1, STEPS + 1):
    loss = nn.functional.mse_loss(model(x[step * 8:(step + 1) * 8]), y[step * 8:(step + 1) * 8])
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
    opt.zero_grad()
    if rank == 0:
        with open(os.path.join(out, "steps.jsonl"), "a") as fh:
            fh.write(json.dumps({"attempt": attempt, "step": step, "t": time.time()}) + "\\n")
    if attempt == 0 and rank == 1 and step == KILL_STEP:
        with open(os.path.join(out, "death.json"), "w") as fh:
            json.dump({"t": time.time()}, fh)
        os.kill(os.getpid(), signal.SIGKILL)
dist.destroy_process_group()
'''.replace("STEPS", str(STEPS)).replace("KILL_STEP", str(KILL_STEP))

PLUGIN = '''
"""Benchmark helper plugin: a gradient-averaging strategy, the kill and the timestamps."""
import json, os, signal, time
from distrun import StrategyInfo, hookimpl


def _make(config):
    import torch.distributed as dist
    from distrun.strategies.base import BaseStrategy

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


@hookimpl(trylast=True)
def distrun_on_step_end(run, step):
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if run.rank == 0:
        _out("steps.jsonl", {"attempt": attempt, "step": step, "t": time.time()})
    if attempt == 0 and run.rank == 1 and step == KILL_STEP:
        with open(os.path.join(os.environ["BENCH_OUT"], "death.json"), "w") as fh:
            json.dump({"t": time.time()}, fh)
        os.kill(os.getpid(), signal.SIGKILL)
'''.replace("KILL_STEP", str(KILL_STEP))

TASK = '''
import torch
from torch import nn
import distrun


class BenchTask(distrun.Task):
    def __init__(self):
        gen = torch.Generator().manual_seed(0)
        self.data = torch.utils.data.TensorDataset(torch.randn(256, 8, generator=gen),
                                                   torch.randn(256, 1, generator=gen))

    def configure_model(self):
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def configure_optimizer(self, params):
        return torch.optim.AdamW(params, lr=0.01)

    def train_data(self):
        return self.data

    def training_step(self, model, batch):
        x, y = batch
        return nn.functional.mse_loss(model(x), y)
'''


def _recovery(out: Path) -> float | None:
    """Seconds from the death to the end of the first step trained after it, or None."""
    try:
        death = json.loads((out / "death.json").read_text())["t"]
    except FileNotFoundError:
        return None
    steps = [json.loads(ln) for ln in (out / "steps.jsonl").read_text().splitlines()]
    after = [s["t"] for s in steps if s["attempt"] > 0 and s["t"] > death]
    return min(after) - death if after else None


def _trial(kind: str, work: Path, index: int) -> tuple[bool, float | None, float | None]:
    out = work / f"{kind}-{index}"
    out.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", BENCH_OUT=str(out), PYTHONPATH=str(work))
    if kind.startswith("torchrun"):
        if kind == "torchrun-fix":
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "--max-restarts", "1", str(work / "plain.py"), str(out)]
    else:
        env.update(DISTRUN_DISABLE_PLUGIN_AUTOLOAD="1",
                   DISTRUN_PLUGINS="distrun_elastic.plugin,distrun_safetensors.plugin,"
                                   "recovery_bench")
        cmd = [sys.executable, "-m", "distrun", "run", "--max-restarts", "1",
               "--nproc-per-node", "2", "--strategy", "benchsum", "--batch-size", "16",
               "--max-steps", str(STEPS), "--ckpt-every-n-steps", "2", "--no-summary",
               "--timeout", "30", "--name", f"bench-{index}", f"{work / 'bench_task.py'}:BenchTask"]
    try:
        proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=300)
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
    return ok, _recovery(out) if ok else None, load


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 trial of each side")
    parser.add_argument("--trials", type=int, default=2)
    args = parser.parse_args(argv)
    trials = 1 if args.quick else args.trials
    work = Path(tempfile.mkdtemp(prefix="distrun-recovery-"))
    try:
        (work / "plain.py").write_text(PLAIN_SCRIPT)
        (work / "recovery_bench.py").write_text(PLUGIN)
        (work / "bench_task.py").write_text(TASK)
        results: dict[str, list[tuple[bool, float | None, float | None]]] = {
            "torchrun": [], "torchrun-fix": [], "distrun": []}
        for i in range(trials):  # interleaved, so both sides see the same machine load
            for kind in results:
                started = time.perf_counter()
                results[kind].append(_trial(kind, work, i))
                ok, rec, _ = results[kind][-1]
                print(f"  trial {i + 1}/{trials} {kind:<12}: "
                      f"{'ok' if ok else 'FAILED'}"
                      f"{f', recovery {rec:.2f} s' if rec is not None else ''}"
                      f" ({time.perf_counter() - started:.0f} s)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return _summary(results, trials)


def _summary(results: dict[str, list[tuple[bool, float | None, float | None]]],
             trials: int) -> int:
    med = {}
    for kind, rows in results.items():
        times = [r for ok, r, _ in rows if ok and r is not None]
        med[kind] = statistics.median(times) if times else None
        rate = sum(ok for ok, _, _ in rows)
        shown = f"{med[kind]:.2f} s" if med[kind] is not None else "n/a"
        print(f"{kind:<12} recovery (median of successful trials): {shown:>8}   "
              f"success {rate}/{trials} ({100 * rate / trials:.0f}%)")
    loads = [ld for _, _, ld in results["distrun"] if ld is not None]
    load = statistics.median(loads) if loads else 0.0
    print(f"distrun checkpoint load (median): {load:.3f} s")
    for base in ("torchrun", "torchrun-fix"):
        if med[base] and med["distrun"]:
            ratio = med["distrun"] / (med[base] + load)
            print(f"ratio distrun / ({base} + load): {ratio:.2f}  (target <= 1.00)")
        else:
            print(f"ratio distrun / ({base} + load): n/a (no successful trial on one side)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
