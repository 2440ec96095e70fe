"""Per-step overhead of distrun's loop: `distrun run --strategy ddp` vs a hand-written DDP loop.

    python benchmarks/step_overhead.py              # ~50K-param model and ~5M-param MLP
    python benchmarks/step_overhead.py --quick      # fewer steps
    python benchmarks/step_overhead.py --launches   # separate launches, 5 of each kind
    python benchmarks/step_overhead.py --launches 9 --quick

For each model, one `distrun run --nproc-per-node 2 --strategy ddp` launch (2 processes,
gloo, OMP_NUM_THREADS=1) runs, in the same two processes and alternating so that machine load
hits both alike: the hand-written loop (nanoGPT-style: DistributedSampler DataLoader, DDP,
zero_grad/forward/backward/step, rank 0 prints the loss every 10 steps) and
`distrun.Trainer(...).fit(task)` on the same model, data, seed, global batch and optimizer,
with its default logging every 10 steps (metrics all-reduced over ranks, console and CSV;
the add-on progress and TensorBoard plugins are blocked: their cost is not the loop's). Steps/s are timed between the end of a
warm-up step and the end of the last step, from inside each loop. Printed: steps/s of both
and the ratio distrun / hand-written (target >= 1.00); best of the repeats and the median.
``--log-every 1000`` takes logging out of the timed steps; ``BENCH_PROFILE=FILE`` dumps a
cProfile of rank 0's distrun fit.

``--memory-tier [N]`` prices the memory tier of checkpoints: N launches (default 5) of
distrun's loop under ``distrun run --strategy ddp``, with and without
``--ckpt-memory-every-n-steps 1`` (a checkpoint of the model and the optimizer's state into
the node's memory at every step), alternated, on the 5M and 50M models with AdamW. Printed: the
median steps/s of both and the ratio with / without (target >= 0.95: at most 5% per step).

``--memory-tier-nodes [N]`` prices the peer replica of a state sharded across nodes: two
launchers on this machine as two nodes of one rank each (``--nnodes 2``, a rendezvous on
loopback), ``--strategy fsdp`` over both, with and without ``--ckpt-memory-every-n-steps 1``
(each node's part saved into its memory and copied into the other's at every step), N
launches of each (default 5), alternated, on the 5M model with AdamW. Printed as above.

``--launches [N]`` compares whole launches instead, as a user would: N launches (default 5) of
each of (1) the hand-written loop as a plain script under ``torchrun --standalone``, (2) the
same script under ``distrun run``, (3) distrun's loop (``Trainer.fit``, as above) under
``distrun run --strategy ddp``, alternated launch by launch, for both models. Each launch times
its own steps (the same way as above) and rank 0 writes them. Printed: the median steps/s of
each kind and the ratios (2)/(1) (target >= 0.99) and (3)/(1) (target >= 1.00).
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
from typing import Any

from distrun.plugin import hookimpl

SIZES = {  # name: (input, hidden layers, classes)
    "tiny-50K": (128, [256, 64], 10),
    "mlp-5M": (512, [2048, 2048], 10),
    "mlp-50M": (4096, [4096, 4096, 4096], 10),  # benchmarks/curves.py's largest point
}
#: (steps, warm-up steps) of each model measured by default, and with --quick
PLAN = {"tiny-50K": (300, 50), "mlp-5M": (40, 8)}
QUICK_PLAN = {"tiny-50K": (150, 20), "mlp-5M": (25, 5)}
GLOBAL_BATCH = 64
LOG_EVERY = int(os.environ.get("BENCH_LOG_EVERY", "10"))
#: add-on logger plugins left out of the comparison (their cost is theirs, not the loop's)
BLOCKED = "progress,tensorboard"


def mlp(size: str) -> Any:
    from torch import nn

    n_in, hidden, n_out = SIZES[size]
    layers: list[nn.Module] = []
    for width in hidden:
        layers += [nn.Linear(n_in, width), nn.ReLU()]
        n_in = width
    layers.append(nn.Linear(n_in, n_out))
    return nn.Sequential(*layers)


def optimizer(params: Any) -> Any:
    """Both loops' optimizer: SGD, or AdamW (two more tensors per parameter to checkpoint)
    with ``BENCH_OPTIM=adamw``."""
    import torch

    if os.environ.get("BENCH_OPTIM") == "adamw":
        return torch.optim.AdamW(params, lr=1e-4)
    return torch.optim.SGD(params, lr=0.01)


def _data(size: str, steps: int) -> Any:
    import torch

    gen = torch.Generator().manual_seed(0)
    n = steps * GLOBAL_BATCH
    x = torch.randn(n, SIZES[size][0], generator=gen)
    y = torch.randint(0, SIZES[size][2], (n,), generator=gen)
    return torch.utils.data.TensorDataset(x, y)


def hand_written(size: str, steps: int, warmup: int) -> float:
    """The baseline: a plain torch DDP loop. Returns steps/s after the warm-up."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    torch.manual_seed(0)
    model = DDP(mlp(size))
    opt = optimizer(model.parameters())
    data = _data(size, steps)
    sampler = DistributedSampler(data, seed=0, drop_last=True)
    loader = DataLoader(data, batch_size=GLOBAL_BATCH // dist.get_world_size(), sampler=sampler,
                        drop_last=True)
    start = None
    for step, (x, y) in enumerate(loader, 1):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if step % LOG_EVERY == 0 and dist.get_rank() == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        if step == warmup:
            start = time.perf_counter()
    return (steps - warmup) / (time.perf_counter() - start)


class _Task:
    def __init__(self, size: str, steps: int) -> None:
        self.size, self.steps = size, steps

    def configure_model(self) -> Any:
        return mlp(self.size)

    def configure_optimizer(self, params: Any) -> Any:
        return optimizer(params)

    def train_data(self) -> Any:
        return _data(self.size, self.steps)

    def training_step(self, model: Any, batch: Any) -> Any:
        import torch.nn.functional as F

        x, y = batch
        return F.cross_entropy(model(x), y)


class _Timer:
    """A plugin: the time at the end of the warm-up step and of the last step."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start = self.end = 0.0

    @hookimpl
    def distrun_on_step_end(self, run: Any, step: int) -> None:
        if step == self.warmup:
            self.start = time.perf_counter()
        self.end = time.perf_counter()


def with_distrun(size: str, steps: int, warmup: int, run_dir: str) -> float:
    import distrun

    timer = _Timer(warmup)
    prof = None
    if os.environ.get("BENCH_PROFILE"):
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    run = distrun.Trainer(plugins=(timer,), batch_size=GLOBAL_BATCH, max_steps=steps, seed=0,
                          summary=False, run_dir=run_dir, log_every_n_steps=LOG_EVERY).fit(
        _Task(size, steps))
    run.pm.unregister(timer)
    if prof is not None and run.is_global_zero:
        prof.disable()
        prof.dump_stats(os.environ["BENCH_PROFILE"])
    return (steps - warmup) / (timer.end - timer.start)


def worker(size: str, steps: int, warmup: int, repeats: int, out: str) -> None:
    """Inside `distrun run`: alternate both loops in this process group; rank 0 writes JSON."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    results: dict[str, list[float]] = {"torch": [], "distrun": []}
    loops = {"torch": lambda: hand_written(size, steps, warmup),
             "distrun": lambda: with_distrun(size, steps, warmup, os.path.dirname(out))}
    for i in range(repeats):
        # alternate which loop goes first, so neither always gets the warmer machine
        for name in (("torch", "distrun") if i % 2 == 0 else ("distrun", "torch")):
            results[name].append(loops[name]())
            dist.barrier()
    if dist.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump(results, fh)
    dist.destroy_process_group()


def launch_worker(kind: str, size: str, steps: int, warmup: int, out: str) -> None:
    """One launch's two processes: one loop, timed from inside; rank 0 writes its steps/s."""
    if kind == "hand":  # a plain torchrun script: it sets up its own process group
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rate = hand_written(size, steps, warmup)
        dist.destroy_process_group()
    else:
        rate = with_distrun(size, steps, warmup, os.path.dirname(out))
    if os.environ.get("RANK") == "0":
        with open(out, "w") as fh:
            json.dump({"steps_per_s": rate}, fh)


#: the launches compared by ``--launches``: (1) and (2) run the same script
KINDS = {"torchrun": "hand-written, torchrun", "distrun-run": "hand-written, distrun run",
         "distrun-loop": "distrun loop, distrun run"}
#: the launches compared by ``--memory-tier``
TIER_KINDS = {"distrun-loop": "distrun loop, distrun run",
              "distrun-memory": "the same, a memory checkpoint every step"}
#: ... and by ``--memory-tier-nodes``
NODE_KINDS = {"distrun-loop": "distrun loop, fsdp over two launchers as two nodes",
              "distrun-memory": "the same, each node's part saved and copied every step"}


def _launch(kind: str, size: str, steps: int, warmup: int, env: dict[str, str]) -> float | None:
    """One whole launch of ``kind``; its steps/s, or None (said) when it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        loop = "distrun" if kind.startswith("distrun-loop") or kind == "distrun-memory" \
            else "hand"
        script = [os.path.abspath(__file__), "--launch-worker", loop, size, str(steps),
                  str(warmup), out]
        if kind == "torchrun":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", "2", *script]
        else:
            cmd = [sys.executable, "-m", "distrun", "run", "--nproc-per-node", "2",
                   *(["--strategy", "ddp", "--run-dir", tmp] if loop == "distrun" else []),
                   *(["--ckpt-memory-every-n-steps", "1"] if kind == "distrun-memory" else []),
                   *script]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tmp)
        if proc.returncode != 0 or not os.path.exists(out):
            print(f"  {size} {kind}: the launch failed (exit {proc.returncode})\n"
                  f"{proc.stderr[-2000:]}", flush=True)
            return None
        with open(out) as fh:
            return float(json.load(fh)["steps_per_s"])


def _launch_nodes(kind: str, size: str, steps: int, warmup: int,
                  env: dict[str, str]) -> float | None:
    """Two launchers as two nodes of one rank, fsdp over both; rank 0's steps/s, or None."""
    from distrun.testing import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "distrun", "run", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "bench",
               "--strategy", "fsdp", "--run-dir", tmp,
               *(["--ckpt-memory-every-n-steps", "1"] if kind == "distrun-memory" else []),
               os.path.abspath(__file__), "--launch-worker", "distrun", size, str(steps),
               str(warmup), out]
        procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True, cwd=tmp) for _ in range(2)]
        errs = [p.communicate()[1] for p in procs]
        if any(p.returncode for p in procs) or not os.path.exists(out):
            print(f"  {size} {kind}: the launch failed (exit {[p.returncode for p in procs]})"
                  f"\n{errs[0][-1500:]}\n{errs[1][-1500:]}", flush=True)
            return None
        with open(out) as fh:
            return float(json.load(fh)["steps_per_s"])


def _alternate(plan: dict[str, tuple[int, int]], kinds: list[str], n: int,
               env: dict[str, str], launch: Any = None,
               ) -> tuple[bool, list[tuple[str, dict[str, list[float]]]]]:
    """``n`` whole launches of every kind per model, alternated launch by launch: whether all
    succeeded, and each model's steps/s per kind (``launch``: one launch, ``_launch``'s
    signature)."""
    launch = launch or _launch
    ok = True
    rows = []
    for size, (steps, warmup) in plan.items():
        rates: dict[str, list[float]] = {k: [] for k in kinds}
        for i in range(n):
            # rotate the order, so that no kind always follows the same one
            for kind in kinds[i % len(kinds):] + kinds[:i % len(kinds)]:
                rate = launch(kind, size, steps, warmup, env)
                if rate is None:
                    ok = False
                    continue
                rates[kind].append(rate)
                print(f"  {size} launch {i + 1}/{n} {kind:<14} {rate:8.2f} steps/s", flush=True)
        rows.append((size, rates))
    return ok, rows


def _medians(rates: dict[str, list[float]]) -> dict[str, float]:
    return {k: statistics.median(v) if v else float("nan") for k, v in rates.items()}


def launches(plan: dict[str, tuple[int, int]], n: int, env: dict[str, str]) -> bool:
    """Alternate whole launches of every kind, ``n`` of each per model; print medians, ratios."""
    print(f"steps/s, separate launches, 2 processes, gloo, global batch {GLOBAL_BATCH}, loss "
          f"logged every {env['BENCH_LOG_EVERY']} steps; median of {n} launches of each kind, "
          "alternated launch by launch", flush=True)
    kinds = list(KINDS)
    ok, rows = _alternate(plan, kinds, n, env)
    print(f"{'model':<10} {'params':>9} " + " ".join(f"{k:>13}" for k in kinds) +
          f" {'run/torchrun':>13} {'loop/torchrun':>14}")
    for size, rates in rows:
        params = sum(p.numel() for p in mlp(size).parameters())
        med = _medians(rates)
        print(f"{size:<10} {params:>9,} " + " ".join(f"{med[k]:>13.1f}" for k in kinds) +
              f" {med['distrun-run'] / med['torchrun']:>13.3f}"
              f" {med['distrun-loop'] / med['torchrun']:>14.3f}")
    print("kinds: " + "; ".join(f"{k} = {v}" for k, v in KINDS.items()))
    print("targets: run/torchrun >= 0.99 (the same script, two launchers); "
          "loop/torchrun >= 1.00 (distrun's loop vs the hand-written one)")
    return ok


def memory_tier(plan: dict[str, tuple[int, int]], n: int, env: dict[str, str],
                nodes: bool = False) -> bool:
    """The per-step cost of a memory checkpoint at every step: launches with and without
    (``nodes``: fsdp over two launchers, each node's part copied into the other's memory)."""
    env = dict(env, BENCH_OPTIM="adamw")
    named = NODE_KINDS if nodes else TIER_KINDS
    print(f"steps/s, separate launches, 2 processes, gloo, AdamW, global batch {GLOBAL_BATCH}; "
          f"median of {n} launches of each kind, alternated launch by launch", flush=True)
    kinds = list(named)
    ok, rows = _alternate(plan, kinds, n, env, _launch_nodes if nodes else _launch)
    print(f"{'model':<10} {'params':>11} {'state MB':>9} " +
          " ".join(f"{k:>15}" for k in kinds) + f" {'memory/loop':>12}")
    for size, rates in rows:
        params = sum(p.numel() for p in mlp(size).parameters())
        med = _medians(rates)
        print(f"{size:<10} {params:>11,} {params * 12 / 1e6:>9.0f} " +
              " ".join(f"{med[k]:>15.2f}" for k in kinds) +
              f" {med['distrun-memory'] / med['distrun-loop']:>12.3f}")
    print("kinds: " + "; ".join(f"{k} = {v}" for k, v in named.items()))
    print("state MB: the parameters and AdamW's two moments, fp32 (what each step checkpoints); "
          "target: memory/loop >= 0.95")
    return ok


def bench_env(log_every: int = LOG_EVERY) -> dict[str, str]:
    """The launches' environment: one thread per process, add-on loggers blocked."""
    return dict(os.environ, OMP_NUM_THREADS="1", DISTRUN_BLOCK_PLUGINS=BLOCKED,
                BENCH_LOG_EVERY=str(log_every))


def in_process(size: str, steps: int, warmup: int, repeats: int,
               env: dict[str, str]) -> dict[str, list[float]] | None:
    """One ``distrun run --nproc-per-node 2 --strategy ddp`` launch alternating both loops in
    the same processes (``--worker``): steps/s of each repeat under ``torch`` and ``distrun``;
    None (said, with the launch's stderr) when it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "distrun", "run", "--nproc-per-node", "2",
               "--strategy", "ddp", "--run-dir", tmp, os.path.abspath(__file__),
               "--worker", size, str(steps), str(warmup), str(repeats), out]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tmp)
        if proc.returncode != 0 or not os.path.exists(out):
            print(f"{size}: the run failed (exit {proc.returncode})\n{proc.stderr[-2000:]}")
            return None
        with open(out) as fh:
            result: dict[str, list[float]] = json.load(fh)
        return result


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    parser.add_argument("--log-every", type=int, default=LOG_EVERY,
                        help="steps between loss logs in both loops (default 10)")
    parser.add_argument("--launches", type=int, nargs="?", const=5, metavar="N",
                        help="compare N separate launches of each kind (default 5)")
    parser.add_argument("--memory-tier", type=int, nargs="?", const=5, metavar="N",
                        help="the memory tier's cost per step: N launches with and without")
    parser.add_argument("--memory-tier-nodes", type=int, nargs="?", const=5, metavar="N",
                        help="the same for fsdp over two launchers as two nodes (the replica)")
    parser.add_argument("--launch-worker", nargs=5, metavar=("KIND", "SIZE", "STEPS", "WARMUP",
                                                             "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--worker", nargs=5, metavar=("SIZE", "STEPS", "WARMUP", "REPEATS",
                                                      "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    env = bench_env(args.log_every)
    if args.worker:
        size, steps, warmup, repeats, out = args.worker
        worker(size, int(steps), int(warmup), int(repeats), out)
        return 0
    if args.launch_worker:
        kind, size, steps, warmup, out = args.launch_worker
        launch_worker(kind, size, int(steps), int(warmup), out)
        return 0
    plan, repeats = (QUICK_PLAN, 2) if args.quick else (PLAN, 3)
    if args.launches is not None:
        # a launch's timed stretch must outlast the machine's hiccups: seconds, not a fraction
        plan = {"tiny-50K": (600, 100), "mlp-5M": (40, 8)} if args.quick else \
            {"tiny-50K": (2000, 200), "mlp-5M": (120, 10)}
        return 0 if launches(plan, max(1, args.launches), env) else 1
    if args.memory_tier is not None:
        plan = {"mlp-5M": (40, 8), "mlp-50M": (12, 3)} if args.quick else \
            {"mlp-5M": (120, 10), "mlp-50M": (30, 5)}
        return 0 if memory_tier(plan, max(1, args.memory_tier), env) else 1
    if args.memory_tier_nodes is not None:
        plan = {"mlp-5M": (40, 8)} if args.quick else {"mlp-5M": (120, 10)}
        return 0 if memory_tier(plan, max(1, args.memory_tier_nodes), env, nodes=True) else 1
    print(f"steps/s, 2 processes, gloo, global batch {GLOBAL_BATCH}, loss logged every "
          f"{args.log_every} steps; best (median) of {repeats} alternating repeats")
    print(f"{'model':<10} {'params':>9} {'torch DDP':>16} {'distrun ddp':>16} {'ratio':>14}")
    ok = True
    for size, (steps, warmup) in plan.items():
        params = sum(p.numel() for p in mlp(size).parameters())
        res = in_process(size, steps, warmup, repeats, env)
        if res is None:
            ok = False
            continue
        t, d = res["torch"], res["distrun"]
        ratio = max(d) / max(t)
        ratio_med = statistics.median(d) / statistics.median(t)
        print(f"{size:<10} {params:>9,} {max(t):>8.1f} ({statistics.median(t):>5.1f}) "
              f"{max(d):>8.1f} ({statistics.median(d):>5.1f}) "
              f"{ratio:>6.3f} ({ratio_med:.3f})")
    print("target: ratio >= 1.00")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
