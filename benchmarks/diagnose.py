"""When a run stalls or slows: how soon the culprit is named, and what the bookkeeping costs.

    python benchmarks/diagnose.py            # 3 launches of each kind; 10 loaded even runs
    python benchmarks/diagnose.py --quick    # 1 launch of each kind; 3 loaded even runs

1. **Fault to culprit.** One hand-written DDP script (a small MLP, gloo, 2 ranks, its own
   ``init_process_group(timeout=30 s)``) whose rank 1 hangs in its step at step 40 (a sleep
   standing for a deadlock), launched alternately under ``torchrun --standalone`` and
   ``distrun run --timeout 30`` (its default stall timeout: 0.8 x 30 = 24 s here, 60 s at the
   default 300 s timeout) and ``distrun run --stall-timeout 5``. Printed per launcher: the
   median seconds from the fault to the first line that names rank 1 (torchrun: none does),
   from the fault to the launcher's exit, and the line each launcher gives.
2. **Bookkeeping cost.** The loop's own cost, so measured in one launch (``--strategy ddp``,
   2 ranks, the ~50K model of ``step_overhead.py``, 300 steps a fit): fits alternately with
   the rank's position record (the phase marks, the compute times taken at each vote) and
   without it (the vote still carries the slots for them, as zeros), in the same two
   processes. A launch-to-launch
   comparison moves by +-20% on a 2-core machine, far more than the cost. Printed: the median
   steps/s of each and their ratio (target: >= 0.99, within noise).
3. **No false straggler.** Even 2-rank runs of 300 steps with a busy process per core beside
   them: the runs in which a rank was named slow (target: 0).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

HANG_STEP = 40
TIMEOUT = 30


def hang_worker(mark: str) -> None:
    """The hand-written script: DDP on a small MLP; rank 1 hangs at step ``HANG_STEP``."""
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    for step in range(1, 10_000):
        if step == HANG_STEP and rank == 1:
            with open(mark, "w") as fh:
                fh.write(repr(time.time()))
            time.sleep(3600)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _names_rank1(line: str) -> bool:
    return bool(re.search(r"\brank 1\b", line)) and "stall" in line


def fault_launch(kind: str, env: dict[str, str]) -> tuple[float | None, float, str]:
    """One launch; (seconds from the fault to a line naming rank 1, to the exit, the line)."""
    with tempfile.TemporaryDirectory() as tmp:
        mark = os.path.join(tmp, "fault")
        script = [str(Path(__file__).resolve()), "--hang-worker", mark]
        if kind == "torchrun":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", "2", *script]
        else:
            flags = ["--timeout", str(TIMEOUT), "--log-dir", tmp]  # (the evidence goes there)
            if kind == "distrun-5s":
                flags += ["--stall-timeout", "5"]
            cmd = [sys.executable, "-m", "distrun", "run", "--nproc-per-node", "2", *flags,
                   *script]
        proc = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        named_at, quoted = None, ""
        assert proc.stderr is not None
        for line in proc.stderr:
            if named_at is None and _names_rank1(line):
                named_at, quoted = time.time(), line.strip()
            if not quoted and ("Timed out" in line or "timed out" in line):
                quoted = line.strip()
        proc.wait()
        ended = time.time()
        fault = float(Path(mark).read_text()) if os.path.exists(mark) else ended
        return (named_at - fault if named_at else None), ended - fault, quoted


def fault_to_culprit(n: int, env: dict[str, str]) -> None:
    kinds = ["torchrun", "distrun", "distrun-5s"]
    results: dict[str, list[tuple[float | None, float, str]]] = {k: [] for k in kinds}
    for i in range(n):
        for kind in kinds[i % 3:] + kinds[:i % 3]:
            got = fault_launch(kind, env)
            results[kind].append(got)
            named = f"{got[0]:.1f} s" if got[0] is not None else "never"
            print(f"  launch {i + 1}/{n} {kind:<11} named rank 1: {named:>7}; exit after "
                  f"{got[1]:.1f} s", flush=True)
    print(f"{'launcher':<12} {'to culprit (s)':>15} {'to exit (s)':>12}  what it says")
    for kind, runs in results.items():
        named = [r[0] for r in runs if r[0] is not None]
        to_name = f"{statistics.median(named):.1f}" if named else "never"
        print(f"{kind:<12} {to_name:>15} {statistics.median(r[1] for r in runs):>12.1f}  "
              f"{(runs[-1][2] or '(no line names a rank)')[:400]}")


def cost_worker(repeats: int, out: str) -> None:
    """Inside `distrun run --strategy ddp`: distrun's loop on the ~50K model, alternately with
    this rank's position record and without it, in the same two processes; rank 0 writes the
    steps/s of each."""
    import json

    import torch
    import torch.distributed as dist
    from step_overhead import with_distrun

    from distrun._diagnose import position

    torch.set_num_threads(1)
    # one process group for every fit (each fit would make and destroy its own otherwise)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    kept = position.recorder()
    assert kept is not None, "run under distrun run (it names the positions folder)"
    rates: dict[str, list[float]] = {"kept": [], "off": []}
    for i in range(repeats):
        for kind in (("kept", "off") if i % 2 == 0 else ("off", "kept")):
            position._recorder = kept if kind == "kept" else None  # what the loop marks into
            rates[kind].append(with_distrun("tiny-50K", 300, 50, os.path.dirname(out)))
            dist.barrier()
    position._recorder = kept
    if dist.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump(rates, fh)
    dist.destroy_process_group()


def marks_cost() -> tuple[float, float]:
    """Microseconds a step's marks take (its phases and the step's end), and a collective's."""
    from distrun._diagnose.position import Phase, Recorder

    with tempfile.TemporaryDirectory() as tmp:
        rec = Recorder(tmp, 0)
        n = 100_000
        started = time.perf_counter()
        for i in range(n):
            for phase in (Phase.DATA, Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER):
                rec.phase(phase)
            rec.step_done(i)
            rec.phase(Phase.BOUNDARY)
        step = (time.perf_counter() - started) / n * 1e6
        started = time.perf_counter()
        for _ in range(n):
            rec.enter(1, True)
            rec.leave()
        coll = (time.perf_counter() - started) / n * 1e6
        rec.close()
    return step, coll


def bookkeeping_cost(n: int, env: dict[str, str]) -> None:
    import json

    step_us, coll_us = marks_cost()
    print(f"  the marks of one step: {step_us:.2f} us; of one collective: {coll_us:.2f} us",
          flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rates.json")
        proc = subprocess.run(
            [sys.executable, "-m", "distrun", "run", "--nproc-per-node", "2", "--strategy", "ddp",
             "--run-dir", tmp, str(Path(__file__).resolve()), "--cost-worker", str(n), out],
            env=env, capture_output=True, text=True, cwd=tmp)
        if proc.returncode or not os.path.exists(out):
            print(f"  the launch failed (exit {proc.returncode}): {proc.stderr[-800:]}")
            return
        with open(out) as fh:
            rates = json.load(fh)
    for kind, values in rates.items():
        print(f"  {kind:<5} " + " ".join(f"{v:7.1f}" for v in values) + " steps/s", flush=True)
    kept, off = statistics.median(rates["kept"]), statistics.median(rates["off"])
    print(f"steps/s, median of {n} fits each: with the record {kept:.1f}, without {off:.1f}; "
          f"ratio {kept / off:.3f} (target >= 0.99; fits vary by +-10% here)")
    print(f"the marks' share of a step of this model: {step_us * 1e-6 * off:.2%} "
          f"({step_us:.2f} us of {1e6 / off:.0f} us)")


def no_false_straggler(n: int, env: dict[str, str]) -> None:
    busy = [subprocess.Popen(["sh", "-c", "while :; do :; done"])
            for _ in range(os.cpu_count() or 1)]
    named = 0
    try:
        for i in range(n):
            with tempfile.TemporaryDirectory() as tmp:
                proc = subprocess.run(
                    [sys.executable, "-m", "distrun", "run", "--nproc-per-node", "2",
                     "--strategy", "ddp", "--run-dir", tmp, str(HERE / "step_overhead.py"),
                     "--launch-worker", "distrun", "tiny-50K", "300", "50",
                     os.path.join(tmp, "r.json")], env=env, capture_output=True, text=True,
                    cwd=tmp)
                said = [ln for ln in (proc.stdout + proc.stderr).splitlines()
                        if "computes" in ln and ("longer" in ln or "as long as" in ln)]
                named += bool(said)
                print(f"  even run {i + 1}/{n}: exit {proc.returncode}, "
                      f"{said[0] if said else 'no rank named slow'}", flush=True)
                if proc.returncode:
                    print("    " + "\n    ".join(proc.stderr.strip().splitlines()[-3:]))
    finally:
        for p in busy:
            p.kill()
            p.wait()
    print(f"even runs under a busy process per core that named a slow rank: {named} of {n} "
          "(target: 0)")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--hang-worker", metavar="MARK")
    parser.add_argument("--cost-worker", nargs=2, metavar=("REPEATS", "OUT"))
    args = parser.parse_args(argv)
    if args.hang_worker:
        hang_worker(args.hang_worker)
        return 0
    if args.cost_worker:
        cost_worker(int(args.cost_worker[0]), args.cost_worker[1])
        return 0
    from step_overhead import bench_env

    env = bench_env()
    print("1. fault to culprit: rank 1 of 2 hangs at step 40 of a hand-written DDP script "
          f"(gloo, timeout {TIMEOUT} s)", flush=True)
    fault_to_culprit(1 if args.quick else 3, env)
    print("\n2. the bookkeeping's cost: distrun's loop (ddp, 2 ranks), ~50K model, 300 steps "
          "a fit, with and without the position record, alternated in one launch", flush=True)
    bookkeeping_cost(4 if args.quick else 10, env)
    print("\n3. even runs of 300 steps beside a busy process per core", flush=True)
    no_false_straggler(3 if args.quick else 10, env)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
