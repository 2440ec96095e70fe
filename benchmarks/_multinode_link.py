"""One slow-link launch of ``benchmarks/multinode.py`` (see its docstring): 2 hosts, 1 rank each."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

from _multinode_faults import launch_env

from distrun.testing.hosts import Testbed

HERE = Path(__file__).resolve().parent
PLAIN = HERE / "_multinode_plain.py"
TASK = HERE / "_multinode_task.py"

KINDS = ("torchrun", "distrun", "distrun-fp16", "distrun-powersgd")
LINKS = ("1gbit", "unshaped")
HOOKS = {"distrun-fp16": ["--ddp-comm-hook", "fp16"],
         "distrun-powersgd": ["--ddp-comm-hook", "powersgd", "--ddp-powersgd-start-iter", "2"]}
#: add-on logger plugins left out of the comparison (their cost is theirs, not the loop's)
BLOCKED = "progress,tensorboard"
LAUNCH_BOUND = 400.0
_count = itertools.count()


def _command(kind: str, rank: int, out: Path, steps: int, warmup: int) -> list[str]:
    static = ["--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "1",
              "--master-addr", "198.18.0.1", "--master-port", "29500"]
    if kind == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *static, str(PLAIN), "link",
                str(out / "result.json"), str(steps), str(warmup)]
    return [sys.executable, "-m", "distrun", "run", *static, "--strategy", "ddp",
            "--batch-size", "64", "--max-steps", str(steps), "--no-summary",
            "--run-dir", str(out / "run"), *HOOKS.get(kind, []), f"{TASK}:LinkTask"]


def link_launch(kind: str, link: str, steps: int, warmup: int,
                work: Path) -> tuple[float | None, str]:
    """One launch on a fresh 2-host testbed; (steps/s, "") or (None, why it failed)."""
    out = work / f"link-{link}-{kind}-{next(_count)}"
    out.mkdir()
    env = launch_env(kind)
    env.update(DISTRUN_PLUGINS="_multinode_task", DISTRUN_BLOCK_PLUGINS=BLOCKED,
               PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")])),
               BENCH_OUT=str(out / "result.json"), BENCH_STEPS=str(steps),
               BENCH_WARMUP=str(warmup))
    with Testbed.up(2) as bed:
        if link != "unshaped":
            for host in bed:
                host.shape(link)
        procs = []
        for host in bed:
            with open(out / f"{host.name}.log", "w") as log:
                procs.append(host.popen(_command(kind, host.index, out, steps, warmup),
                                        env=env, cwd=out, stdout=log,
                                        stderr=subprocess.STDOUT))
        try:
            codes = [p.wait(timeout=LAUNCH_BOUND) for p in procs]
        except subprocess.TimeoutExpired:
            return None, f"still running after {LAUNCH_BOUND:.0f} s"
    result = out / "result.json"
    if any(codes) or not result.exists():
        tail = (out / "host0.log").read_text(errors="replace").strip().splitlines()[-1:]
        return None, f"exit {codes}: {' '.join(tail)[:200]}"
    return float(json.loads(result.read_text())["steps_per_s"]), ""
