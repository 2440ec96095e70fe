"""Process-group backends side by side on one machine: shm (distrun-shm) against gloo.

    python benchmarks/backends.py                  # quiet, then contended (~5 minutes, 2 cores)
    python benchmarks/backends.py --quick          # fewer repeats
    python benchmarks/backends.py --load quiet     # one scenario: quiet, busy or over

Each scenario is one run: the default group is gloo and a second group over the same ranks is
shm, so both are timed in the same processes, alternating, on the same tensors. Scenarios:
- quiet: 2 ranks on an otherwise idle machine;
- busy: 2 ranks while one CPU-bound process per core runs (``python -c "while 1: pass"``,
  started before and killed after the ranks);
- over: 4 ranks pinned to 2 cores (more ranks than cores: a waiting rank must hand its core
  to the peer it waits for).
The contended scenarios end in one table of shm speed / gloo speed per row (target >= 1.0 on
every row). Printed (never asserted), each shm figure as a ratio against gloo's measured in
the same run:
- all_reduce latency (float32 SUM) at 4 B, 4 KB, 64 KB; targets shm <= 0.25 x gloo;
- all_reduce bandwidth (bytes / time) at 1 MB, 16 MB, 64 MB; targets at 64 MB: >= 2 x gloo,
  and >= 0.5 x a single-process memcpy of the same bytes (timed by rank 0 before the groups);
- all_gather_into_tensor and reduce_scatter_tensor at 16 MB (output resp. input size);
- DDP steps/s (forward, backward with gradient all-reduce, SGD step; batch 32 per rank) on a
  51.6K-parameter MLP (target shm >= 1.3 x gloo) and a 5.0M-parameter MLP.
Each figure is the best of a few alternating repeats of a timed loop (median over loops would
mostly measure the machine's other load). Under contention the collectives' loops run a quarter
of the iterations (each takes longer); DDP runs the same steps.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

MLPS = {"mlp-51.6K": (128, [256, 64], 32), "mlp-5.0M": (512, [2048, 1920], 10)}
BATCH = 32
SCENARIOS = {"quiet": "2 ranks, quiet", "busy": "2 ranks, one busy process per core",
             "over": "4 ranks on 2 cores"}


def _best(fn: Any, iters: int, repeats: int, sync: Any) -> float:
    """Seconds per call: the best over ``repeats`` loops of ``iters`` calls."""
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def _memcpy_seconds(nbytes: int, repeats: int) -> float:
    import torch

    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return min(_timeit(lambda: dst.copy_(src)) for _ in range(repeats))


def _timeit(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _mlp(name: str) -> Any:
    from torch import nn

    n_in, hidden, n_out = MLPS[name]
    layers: list[Any] = []
    for width in hidden:
        layers += [nn.Linear(n_in, width), nn.ReLU()]
        n_in = width
    layers.append(nn.Linear(n_in, n_out))
    return nn.Sequential(*layers)


def rank_main(rank: int, world: int, quick: bool, scale: int,
              cpus: list[int] | None) -> dict[str, Any]:
    """This rank's timings; collectives run ``1 / scale`` of their loops; pinned to ``cpus``."""
    import warnings

    if cpus is not None:
        os.sched_setaffinity(0, cpus)  # before torch starts any thread

    # torch 2.13 calls all_gather_into_tensor / reduce_scatter_tensor deprecated (FutureWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from distrun_shm.backend import load

    load()
    torch.manual_seed(0)
    repeats = 3 if quick else 5
    out: dict[str, Any] = {}
    if rank == 0:  # before any group exists, so the other rank is idle
        out["memcpy_64MB"] = _memcpy_seconds(64 << 20, repeats * 2)
    groups = {"gloo": dist.group.WORLD, "shm": dist.new_group(backend="shm")}

    def sync() -> None:
        dist.barrier(group=groups["gloo"])

    for label, nbytes, iters in [("4 B", 4, 2000), ("4 KB", 4 << 10, 2000),
                                 ("64 KB", 64 << 10, 500), ("1 MB", 1 << 20, 100),
                                 ("16 MB", 16 << 20, 12), ("64 MB", 64 << 20, 4)]:
        t = torch.ones(nbytes // 4)
        iters = max(2, iters // (4 if quick else 1) // scale)
        for name, g in groups.items():
            dist.all_reduce(t, group=g)
            out[f"all_reduce {label} {name}"] = _best(
                lambda g=g, t=t: dist.all_reduce(t, group=g), iters, repeats, sync)
            t.fill_(1.0)
    n = (16 << 20) // 4
    for name, g in groups.items():
        full, part = torch.ones(n), torch.empty(n // world)
        shard = torch.ones(n // world)
        out[f"all_gather 16 MB {name}"] = _best(
            lambda g=g, o=full, i=shard: dist.all_gather_into_tensor(o, i, group=g), 6, repeats, sync)
        out[f"reduce_scatter 16 MB {name}"] = _best(
            lambda g=g, o=part, i=full: dist.reduce_scatter_tensor(o, i, group=g), 6, repeats, sync)
    for mlp in MLPS:
        n_in, _, n_out = MLPS[mlp]
        x = torch.randn(BATCH, n_in)
        y = torch.randint(0, n_out, (BATCH,))
        models = {}
        for name, g in groups.items():
            torch.manual_seed(0)
            model = DDP(_mlp(mlp), process_group=g)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            models[name] = (model, opt)
        steps = (60 if quick else 100) if mlp == "mlp-51.6K" else (4 if quick else 10)
        for name in groups:
            model, opt = models[name]

            def step(model: Any = model, opt: Any = opt, x: Any = x, y: Any = y) -> None:
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x), y).backward()
                opt.step()

            for _ in range(5):  # DDP's first steps rebuild buckets
                step()
            out[f"ddp {mlp} {name}"] = _best(step, steps, repeats, sync)
        out[f"params {mlp}"] = sum(p.numel() for p in models["gloo"][0].parameters())
    return out


def _size(label: str) -> int:
    value, unit = label.split()
    return int(value) * {"B": 1, "KB": 1 << 10, "MB": 1 << 20}[unit]


ROWS = [*(f"all_reduce {label}" for label in ("4 B", "4 KB", "64 KB", "1 MB", "16 MB", "64 MB")),
        "all_gather 16 MB", "reduce_scatter 16 MB", *(f"ddp {mlp}" for mlp in MLPS)]


def report(r: dict[str, Any], world: int) -> None:
    print(f"\nall_reduce latency, float32 SUM, {world} ranks (target shm <= 0.25 x gloo)")
    print(f"{'size':>8} {'gloo us':>10} {'shm us':>10} {'shm/gloo':>9}")
    for label in ("4 B", "4 KB", "64 KB"):
        g, s = r[f"all_reduce {label} gloo"], r[f"all_reduce {label} shm"]
        print(f"{label:>8} {g * 1e6:>10.1f} {s * 1e6:>10.1f} {s / g:>9.3f}")
    print(f"\nall_reduce bandwidth (size / time), {world} ranks (target at 64 MB: shm >= 2 x "
          "gloo)")
    print(f"{'size':>8} {'gloo GB/s':>10} {'shm GB/s':>10} {'shm/gloo':>9}")
    for label in ("1 MB", "16 MB", "64 MB"):
        nbytes = _size(label)
        g, s = r[f"all_reduce {label} gloo"], r[f"all_reduce {label} shm"]
        print(f"{label:>8} {nbytes / g / 1e9:>10.2f} {nbytes / s / 1e9:>10.2f} {g / s:>9.2f}")
    mem = (64 << 20) / r["memcpy_64MB"]
    shm64 = (64 << 20) / r["all_reduce 64 MB shm"]
    print(f"single-process memcpy of 64 MB: {mem / 1e9:.2f} GB/s; shm all_reduce / memcpy = "
          f"{shm64 / mem:.2f} (target >= 0.5)")
    print(f"\n16 MB collectives, {world} ranks (ms; ratio = gloo time / shm time)")
    print(f"{'op':<16} {'gloo ms':>9} {'shm ms':>9} {'speed-up':>9}")
    for op in ("all_gather", "reduce_scatter"):
        g, s = r[f"{op} 16 MB gloo"], r[f"{op} 16 MB shm"]
        print(f"{op:<16} {g * 1e3:>9.2f} {s * 1e3:>9.2f} {g / s:>9.2f}")
    print(f"\nDDP steps/s, {world} ranks, batch {BATCH} per rank, SGD (target mlp-51.6K: shm >= "
          "1.3 x gloo)")
    print(f"{'model':<10} {'params':>10} {'gloo':>9} {'shm':>9} {'shm/gloo':>9}")
    for mlp in MLPS:
        g, s = 1 / r[f"ddp {mlp} gloo"], 1 / r[f"ddp {mlp} shm"]
        print(f"{mlp:<10} {r[f'params {mlp}']:>10,} {g:>9.1f} {s:>9.1f} {s / g:>9.2f}")


def summary(runs: dict[str, dict[str, Any]]) -> None:
    """One row per figure, one column per scenario: shm speed / gloo speed (>= 1.0: shm ahead)."""
    names = list(runs)
    print("\nshm speed / gloo speed (gloo time / shm time; target >= 1.0 on every row)")
    print(f"{'figure':<22}" + "".join(f"{name:>8}" for name in names))
    for row in ROWS:
        cells = "".join(f"{runs[n][f'{row} gloo'] / runs[n][f'{row} shm']:>8.2f}" for n in names)
        print(f"{row:<22}{cells}")
    low = min(runs[n][f"{row} gloo"] / runs[n][f"{row} shm"] for n in names for row in ROWS)
    print(f"lowest: {low:.2f}")


@contextlib.contextmanager
def busy_processes(count: int) -> Iterator[None]:
    """``count`` CPU-bound processes while the block runs; killed (and reaped) after it."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait()


def run_scenario(name: str, quick: bool) -> dict[str, Any]:
    from distrun.testing import run_on_ranks

    world, scale, cpus = 2, 1, None
    load = contextlib.nullcontext()
    if name == "busy":
        scale, load = 4, busy_processes(os.cpu_count() or 1)
    elif name == "over":
        world, scale, cpus = 4, 4, sorted(os.sched_getaffinity(0))[:2]
    with load:
        return run_on_ranks(rank_main, world, quick, scale, cpus, init_process_group=True,
                            timeout=1200)[0] | {"world": world}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations and repeats")
    parser.add_argument("--load", choices=[*SCENARIOS, "contended", "all"], default="all",
                        help="which scenarios: one, busy + over (contended), or all (default)")
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        from distrun_shm.build import unavailable
    except ImportError:
        print("distrun-shm is not installed (pip install -e plugins_contrib/shm): skipped")
        return 0
    reason = unavailable()
    if reason:
        print(f"the shm backend cannot run here: {reason}: skipped")
        return 0
    from distrun_shm.build import load_extension

    load_extension()  # compile (once) before the clock and the ranks' timeout start
    names = {"all": list(SCENARIOS), "contended": ["busy", "over"]}.get(args.load, [args.load])
    runs = {}
    for name in names:
        start = time.perf_counter()
        print(f"\n=== {name}: {SCENARIOS[name]}")
        runs[name] = run_scenario(name, args.quick)
        report(runs[name], runs[name]["world"])
        print(f"(measured in {time.perf_counter() - start:.0f} s; "
              f"{datetime.datetime.now():%Y-%m-%d %H:%M})")
    summary(runs)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
