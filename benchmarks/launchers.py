"""The same 2-worker DDP job under the local launcher and under the Ray launcher, side by side.

    python benchmarks/launchers.py [--quick] [--steps N] [--repeats R] [--ray-address ADDR]

Each launch runs one torchrun-style script (a small MLP trained with torch's DDP over gloo);
rank 0 times the steps after a warm-up. Printed per launcher (median of the repeats): steps/s,
the wall time of the whole `distrun run` and its start-up cost, i.e. the wall time minus the
timed steps (connecting, placing and starting the workers, the process group, the warm-up and
the exit), then the Ray/local ratios. Without --ray-address a throwaway Ray head on 127.0.0.1
is started (its own start time is printed apart: a cluster is started once, not per job) and
stopped. Ray or distrun-ray missing (`pip install distrun-ray`): only the local line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

JOB = """
import datetime, json, os, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 64)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
steps, warmup = int(sys.argv[1]), int(sys.argv[2])
x, y = torch.randn(32, 64), torch.randn(32, 64)
for step in range(steps + warmup):
    if step == warmup:
        dist.barrier()
        t0 = time.perf_counter()
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
dist.barrier()
elapsed = time.perf_counter() - t0
if dist.get_rank() == 0:
    print("BENCH " + json.dumps({"steps_per_s": steps / elapsed}), flush=True)
dist.destroy_process_group()
"""


def _launch(extra: list[str], script: str, steps: int, warmup: int, cwd: str
            ) -> tuple[float, float]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "distrun", "run", *extra, script, str(steps),
                           str(warmup)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=900)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"launch failed ({' '.join(extra)}):\n{proc.stdout}\n{proc.stderr}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH "))
    return json.loads(line[6:])["steps_per_s"], wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and one repeat")
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=0)
    parser.add_argument("--ray-address", default="")
    args = parser.parse_args()
    steps = args.steps or (100 if args.quick else 400)
    repeats = args.repeats or (1 if args.quick else 2)
    warmup = 10
    work = tempfile.mkdtemp(prefix="bench-launchers-")
    script = os.path.join(work, "job.py")
    with open(script, "w") as fh:
        fh.write(JOB)

    setups = {"local": ["--nproc-per-node", "2"]}
    cluster = None
    head_start = None
    try:
        import ray  # noqa: F401

        from distrun_ray.local_cluster import LocalRayCluster
    except ImportError:
        print("ray or distrun-ray is not installed: only the local launcher is measured")
    else:
        address = args.ray_address
        if not address:
            cluster = LocalRayCluster(num_cpus=2, start_timeout=300)
            t0 = time.perf_counter()
            address = cluster.start()
            head_start = time.perf_counter() - t0
        setups["ray"] = ["--launcher", "ray", "--ray-address", address, "--ray-num-workers",
                         "2"]
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in setups}
    try:
        for _ in range(repeats):  # interleaved, so machine load hits both alike
            for name, extra in setups.items():
                results[name].append(_launch(extra, script, steps, warmup, work))
    finally:
        if cluster is not None:
            left = cluster.stop()
            if left:
                print(f"warning: Ray processes left after stopping the head: {sorted(left)}")

    print(f"2 workers, DDP MLP 64-256-64, batch 32, gloo, {steps} timed steps, "
          f"median of {repeats}")
    if head_start is not None:
        print(f"  ray head start (once per cluster, not per job): {head_start:.1f} s")
    med = {}
    for name, runs in results.items():
        sps = statistics.median(s for s, _ in runs)
        wall = statistics.median(w for _, w in runs)
        startup = statistics.median(w - steps / s for s, w in runs)
        med[name] = (sps, wall, startup)
        print(f"  {name:<6} {sps:8.1f} steps/s   wall {wall:6.1f} s   start-up {startup:5.1f} s")
    if "ray" in med:
        (rs, rw, ru), (ls, lw, lu) = med["ray"], med["local"]
        print(f"  ray/local: steps/s ratio {rs / ls:.3f}   wall ratio {rw / lw:.2f}   "
              f"start-up ratio {ru / lu:.2f} (+{ru - lu:.1f} s per job)")


if __name__ == "__main__":
    main()
