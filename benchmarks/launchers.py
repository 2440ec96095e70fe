"""The same 2-worker DDP job under the local launcher and under the Ray launcher, side by side.

    python benchmarks/launchers.py [--quick] [--steps N] [--repeats R] [--ray-address ADDR]

Each launch runs one torchrun-style script (a small MLP trained with torch's DDP over gloo);
rank 0 times the steps after a warm-up. Printed: steps/s (median of the repeats), wall time of
the whole `distrun run` (start-up included) and the Ray/local ratios. Without --ray-address a
throwaway Ray head on 127.0.0.1 is started and stopped. Ray missing: only the local line.
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


def _launch(extra: list[str], script: str, steps: int, warmup: int, cwd: str) -> tuple[float, float]:
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
    try:
        import ray  # noqa: F401

        address = args.ray_address
        if not address:
            from distrun_ray.local_cluster import LocalRayCluster

            cluster = LocalRayCluster(num_cpus=2, start_timeout=300)
            address = cluster.start()
        setups["ray"] = ["--launcher", "ray", "--ray-address", address, "--ray-num-workers",
                         "2"]
    except ImportError:
        print("ray: not installed, only the local launcher is measured")
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in setups}
    try:
        for _ in range(repeats):  # interleaved, so machine load hits both alike
            for name, extra in setups.items():
                results[name].append(_launch(extra, script, steps, warmup, work))
    finally:
        if cluster is not None:
            cluster.stop()

    print(f"2 workers, DDP MLP 64-256-64, batch 32, gloo, {steps} timed steps, "
          f"median of {repeats}")
    med = {k: (statistics.median(s for s, _ in v), statistics.median(w for _, w in v))
           for k, v in results.items()}
    for name, (sps, wall) in med.items():
        print(f"  {name:<6} {sps:8.1f} steps/s   wall {wall:6.1f} s (start-up included)")
    if "ray" in med:
        print(f"  ray/local steps/s ratio {med['ray'][0] / med['local'][0]:.3f}   "
              f"wall ratio {med['ray'][1] / med['local'][1]:.2f}")


if __name__ == "__main__":
    main()
