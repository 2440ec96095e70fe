"""Strategies side by side on the tiny GPT: memory per rank and steps/s; FSDP vs torch by hand.

    python benchmarks/strategies.py            # default sizes (~2-3 minutes on 2 CPU cores)
    python benchmarks/strategies.py --quick    # fewer steps, smaller model

Part 1 trains the same model with the same global batch under single (1 process), ddp, fsdp
and tp (2 processes each) and prints, per rank: the bytes of parameters + gradients +
optimizer state this rank holds (counted from the local tensors: DTensor shards count their
local piece), the process's peak RSS, and optimizer steps per second after a warm-up.

Part 2 times distrun's fsdp strategy against a hand-written FSDP2 loop (init_device_mesh,
fully_shard on each block then the root, AdamW, batches from a DistributedSampler) on the
same model and data, alternating the two a few times and keeping each one's best median step
time. The hand-written loop runs twice: with its DataLoader in the loop (as distrun) and with
its batches collated before the clock starts (a harder baseline). Target: distrun's steps/s >= 0.97 x the
hand-written loop's.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parent / "examples" / "tiny_gpt.py"
PLUGINS = ("distrun_ddp.plugin", "distrun_fsdp.plugin", "distrun_tp.plugin")


def _example() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("tiny_gpt_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _local_bytes(t: Any) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


class Probe:
    """Times optimizer steps and counts this rank's parameter/gradient/optimizer bytes."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.stamps: list[float] = []
        self.param_bytes = self.grad_bytes = self.optim_bytes = 0

    def register(self) -> Any:
        import distrun

        probe = self

        class _Plugin:
            @distrun.hookimpl(wrapper=True)
            def distrun_optimizer_step(self, run: Any) -> Any:
                if not probe.grad_bytes:  # gradients are complete here, before the step
                    params = list(run.model.parameters())
                    probe.param_bytes = sum(_local_bytes(p) for p in params)
                    probe.grad_bytes = sum(_local_bytes(p.grad) for p in params
                                           if p.grad is not None)
                result = yield
                if not probe.optim_bytes:
                    probe.optim_bytes = sum(_local_bytes(v) for s in run.optimizer.state.values()
                                            for v in s.values() if hasattr(v, "numel"))
                return result

            @distrun.hookimpl
            def distrun_on_step_end(self, run: Any, step: int) -> None:
                probe.stamps.append(time.perf_counter())

        return _Plugin()

    def median_step(self) -> float:
        gaps = [b - a for a, b in zip(self.stamps[self.warmup:], self.stamps[self.warmup + 1:])]
        return statistics.median(gaps) if gaps else float("nan")


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    os.environ["DISTRUN_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    os.environ.pop("DISTRUN_CONFIG", None)


def distrun_rank(rank: int, world: int, strategy: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """One rank of a distrun fit of the tiny GPT; this rank's measurements."""
    _quiet()
    import importlib.util

    os.environ["DISTRUN_PLUGINS"] = ",".join(
        p for p in PLUGINS if importlib.util.find_spec(p.split(".")[0]) is not None)
    os.environ.update(TINY_GPT_DIM=str(cfg["dim"]), TINY_GPT_LAYERS=str(cfg["layers"]))
    import logging

    import distrun

    logging.getLogger("distrun").disabled = True
    probe = Probe(cfg["warmup"])
    task = _example().TinyGPTTask()
    task.val_data = lambda: None  # type: ignore[method-assign]
    run = distrun.Trainer(plugins=(probe.register(),), strategy=strategy, summary=False,
                          max_steps=cfg["steps"], batch_size=cfg["batch"], log_every_n_steps=10**6,
                          seed=0, timeout=300.0, run_dir=cfg["run_dir"]).fit(task)
    return {"step": probe.median_step(), "params": probe.param_bytes, "grads": probe.grad_bytes,
            "optim": probe.optim_bytes, "rss": _peak_rss(), "loss": run.metrics.get("loss")}


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def hand_fsdp_rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """The same training written directly against torch's FSDP2 API (the baseline)."""
    _quiet()
    os.environ.update(TINY_GPT_DIM=str(cfg["dim"]), TINY_GPT_LAYERS=str(cfg["layers"]))
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, DistributedSampler

    example = _example()
    task = example.TinyGPTTask()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = task.configure_model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    opt = torch.optim.AdamW(model.parameters(), lr=task.lr, weight_decay=0.0)
    sampler = DistributedSampler(task.train_set, num_replicas=world, rank=rank, seed=0,
                                 drop_last=True)
    loader = DataLoader(task.train_set, batch_size=cfg["batch"] // world, sampler=sampler,
                        drop_last=True)
    if cfg.get("preload"):  # batches collated before timing: no data loading in the loop
        loader = [b for _, b in zip(range(cfg["steps"]), loader)]  # type: ignore[assignment]
    stamps = []
    model.train()
    for step, (x, y) in enumerate(loader):
        if step >= cfg["steps"]:
            break
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        stamps.append(time.perf_counter())
    dist.barrier()
    w = cfg["warmup"]
    gaps = [b - a for a, b in zip(stamps[w:], stamps[w + 1:])]
    return {"step": statistics.median(gaps)}


def _mb(n: float) -> str:
    return f"{n / 2**20:8.2f}"


def part1(cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    import importlib.util

    from distrun.testing import run_on_ranks

    have_ddp = importlib.util.find_spec("distrun_ddp") is not None
    rows: dict[str, dict[str, Any]] = {}
    plan = [("single", 1), *([("ddp", 2)] if have_ddp else []), ("fsdp", 2), ("tp", 2)]
    for name, world in plan:
        out = run_on_ranks(distrun_rank, world, name, dict(cfg, run_dir=f"{cfg['tmp']}/{name}"),
                           timeout=600)
        rows[name] = {k: max(o[k] for o in out) for k in ("params", "grads", "optim", "rss")}
        rows[name]["step"] = max(o["step"] for o in out)
        rows[name]["world"] = world
        rows[name]["loss"] = out[0]["loss"]
    print("\nper rank (max over ranks); state = parameters + gradients + optimizer state")
    print(f"{'strategy':<8} {'ranks':>5} {'params MB':>9} {'grads MB':>9} {'optim MB':>9} "
          f"{'state MB':>9} {'peak RSS MB':>11} {'steps/s':>8}")
    for name, r in rows.items():
        state = r["params"] + r["grads"] + r["optim"]
        r["state"] = state
        print(f"{name:<8} {r['world']:>5} {_mb(r['params']):>9} {_mb(r['grads']):>9} "
              f"{_mb(r['optim']):>9} {_mb(state):>9} {_mb(r['rss']):>11} "
              f"{1 / r['step']:8.2f}")
    base = rows.get("ddp", rows["single"])
    base_name = "ddp" if "ddp" in rows else "single"
    for name in ("fsdp", "tp"):
        print(f"{name} state per rank / {base_name}'s: {rows[name]['state'] / base['state']:.3f} "
              f"(1/N = {1 / rows[name]['world']:.3f})")
    return rows


def part2(cfg: dict[str, Any], rounds: int) -> float:
    from distrun.testing import run_on_ranks

    best = {"hand, DataLoader in the loop": float("inf"), "hand, batches preloaded": float("inf"),
            "distrun --strategy fsdp": float("inf")}
    for i in range(rounds):
        for name in best:
            if name.startswith("hand"):
                out = run_on_ranks(hand_fsdp_rank, 2, dict(cfg, preload="preloaded" in name),
                                   init_process_group=True, timeout=600)
            else:
                out = run_on_ranks(distrun_rank, 2, "fsdp",
                                   dict(cfg, run_dir=f"{cfg['tmp']}/p2-{i}"), timeout=600)
            best[name] = min(best[name], max(o["step"] for o in out))
    print(f"\nFSDP median step time, best of {rounds} alternating runs (2 ranks):")
    for name, step in best.items():
        print(f"  {name:<30} {step * 1e3:8.1f} ms")
    ours = best["distrun --strategy fsdp"]
    ratios = [best[n] / ours for n in best if n.startswith("hand")]
    print(f"distrun fsdp steps/s vs hand-written: {ratios[0]:.3f} (DataLoader), "
          f"{ratios[1]:.3f} (preloaded batches); target >= 0.97")
    return ratios[0]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, smaller model")
    args = parser.parse_args(argv)
    import tempfile

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cfg = dict(dim=128, layers=4, batch=16, steps=40, warmup=5) if not args.quick else \
        dict(dim=64, layers=2, batch=16, steps=15, warmup=3)
    with tempfile.TemporaryDirectory() as tmp:
        cfg["tmp"] = tmp
        print(f"tiny GPT dim {cfg['dim']} x {cfg['layers']} layers, global batch {cfg['batch']}, "
              f"{cfg['steps']} steps (first {cfg['warmup']} not timed), gloo on CPU")
        part1(cfg)
        part2(cfg, rounds=2 if args.quick else 3)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
