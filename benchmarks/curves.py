"""Cost curves: what a checkpoint, a restart, a launch and a step cost as the size grows, each
point against its anchor measured in the same run. One PNG per curve, and a table of every
point (values and the ratio distrun / anchor); nothing is asserted.

    python benchmarks/curves.py                          # every curve, full sizes
    python benchmarks/curves.py checkpoint step          # some curves
    python benchmarks/curves.py --quick                  # small sizes, 1 repeat
    python benchmarks/curves.py checkpoint --sizes 0.1,1 --ranks 2 --repeats 5

Within every point the anchor and distrun alternate, the first one rotating from round to round,
so machine load hits both alike; each figure is the median of ``--repeats`` rounds (3; 1 with
``--quick``). Plots go to ``--img-dir`` (docs/img; with ``--quick`` a temporary folder, so a
quick run never replaces the full run's plots).

- ``checkpoint`` (curve-checkpoint.png): save and load GB/s and the peak extra RSS during the
  save, for float32 models of ``--sizes`` GB (0.1, 0.5, 1, 2, 4; 16 square weights) on
  ``--ranks`` gloo CPU ranks (1, 2, 4). distrun: ``Checkpointer(folder, keep_last=1).save(step,
  model)`` then ``.wait()``, and ``load(folder/step-N, model)`` (checksums verified, its
  default). Anchors: ``dd if=/dev/zero oflag=direct`` of the same bytes per rank, all ranks at
  once (the disk's write speed), and torch.distributed.checkpoint (DCP) save/load of the same
  state dict; for loads also ``dd iflag=direct`` reading the dd file back (the disk's read
  speed). Each time is the slowest
  rank's, barrier to barrier. Every save is durable (distrun and DCP fsync). Loads are from
  the disk: before each one, every file is dropped from the page cache (fsync, then
  ``posix_fadvise(DONTNEED)``, no root needed), because distrun writes with O_DIRECT (nothing
  left cached) and DCP through the page cache (everything cached): warm loads would compare
  the disk with memory.

  Memory layout: **sharded**. Every weight is a DTensor split by rows over the ranks
  (``Shard(0)`` on a 1-D mesh, FSDP's layout), so a point's size is the model's total over its
  ranks and each rank holds and writes size / ranks; loads go back into the same model (zeroed
  first, untimed, and checked bit-exact after). The RAM of a point is then about the model
  once plus a few hundred MB per rank (printed per point: the sum of the ranks' peak RSS),
  about 5-6 GB at 4 GB on 4 ranks. Why not DDP's replicated layout: it holds a copy per rank, 16 GB at 4 GB on
  4 ranks (32 GB with a separate load target), past this 2-core, 24 GiB, swapless machine and
  its ~14 GiB budget for a benchmark. Replicated tensors backed by one shared mapping would
  keep one copy, but every rank would load into the same pages at once and every rank's RSS
  would count them, so neither the loads nor the extra-RSS figure would mean what they say.
  A point that would not fit in the memory available now is skipped, and said.

- ``restart`` (curve-restart.png): failure -> end of the first resumed step against the model's
  parameter count (``--params``: 1M, 10M, 100M, 300M), with recovery.py's machinery and its two
  sides: ``distrun run --max-restarts 1`` running distrun's loop with the safetensors checkpoint
  (warm restarts, the default), against ``torchrun --standalone --max-restarts 1`` with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` running a plain script with torch.save/torch.load of
  the same state (model and AdamW). 2 processes; the model is recovery.py's MLP made wider and
  deeper; each side checkpoints at step 4 only, rank 1 SIGKILLs itself at the end of step 5,
  and both resume from step 4's checkpoint (checked: the first step trained after the restart
  must be 5). Not killed at step 4 itself: the kill is a step-end hook that runs before
  distrun's checkpoint hook of the same step, so distrun would restart from nothing (a tiny
  model in recovery.py, dying at step 50, resumes from 48's). A third side is the same distrun
  run with the memory tier (``--ckpt-memory-every-n-steps 1``): it resumes from the newest
  checkpoint in the node's memory (its ``resumed`` column: the steps it did not redo). Also
  printed: the two parts of the
  recovery (detect + respawn, worker start -> first step) and distrun's load time. The top is
  300M, not 400M: AdamW on 2 replicated ranks holds 16 bytes per parameter per rank (weights,
  gradients, two moments), 9.6 GB at 300M and 12.8 GB at 400M before the processes' own ~2 GB.

- ``startup`` (curve-startup.png): launcher start -> every rank has finished step 1, for
  ``--procs`` processes (1, 2, 4, 8): ``distrun run --nproc-per-node N`` against ``torchrun
  --standalone --nproc-per-node N`` on the same tiny plain torch DDP script; each rank writes
  its wall-clock time after step 1, the clock starts just before the launcher's Popen.

- ``step`` (curve-step.png): steps/s of distrun's loop against the hand-written DDP loop for the
  ``--models`` of step_overhead.py (tiny-50K: 50.1K parameters, mlp-5M: 5.3M, mlp-50M: 50.4M),
  with its in-process mode: one ``distrun run --nproc-per-node 2 --strategy ddp`` launch per
  model alternates both loops in the same processes.

Every process the launches leave behind is killed (this process makes itself their
subreaper), and scratch files are deleted between points, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import checkpoint  # noqa: E402  (sibling benchmarks, reused)
import recovery  # noqa: E402
import step_overhead  # noqa: E402

GB = checkpoint.GB
MIB = 1 << 20
REPO = Path(__file__).resolve().parent.parent
CURVES = ("checkpoint", "restart", "startup", "step")

#: one plotted line (label, xs, ys; a None y is a failed point) and one panel (title, y label,
#: lines)
Line = tuple[str, list[float], list[float | None]]
Panel = tuple[str, str, list[Line]]


# -- helpers shared by the curves -------------------------------------------------------------

def _rotated(items: Sequence[str], i: int) -> list[str]:
    """``items`` starting at ``i``: which side goes first changes from round to round."""
    k = i % len(items)
    return [*items[k:], *items[:k]]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _fmt(value: float | None, spec: str, width: int) -> str:
    return f"{value:{width}{spec}}" if value is not None else f"{'n/a':>{width}}"


def _count(text: str) -> int:
    """``"300M"``, ``"1.5G"``, ``"2e6"`` -> a number."""
    scale = {"K": 1e3, "M": 1e6, "G": 1e9}.get(text[-1:].upper(), 1)
    return int(float(text[:-1] if scale != 1 else text) * scale)


def _available() -> int:
    """Bytes of memory available now (MemAvailable: free plus reclaimable page cache)."""
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _fits(need: float, what: str) -> bool:
    """Whether ``need`` bytes fit in what is available, with 1 GiB to spare (no swap here: an
    overcommitted point would bring the OOM killer, maybe onto someone else's process)."""
    have = _available() - (1 << 30)
    if need <= have:
        return True
    print(f"  {what}: skipped, it needs ~{need / GB:.1f} GB and {max(have, 0) / GB:.1f} GB are "
          "available", flush=True)
    return False


def _adopt_orphans() -> None:
    """Make this process the subreaper of everything below it: a worker that a launcher left
    behind is reparented here rather than to init, so :func:`_reap` still finds it."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def _reap() -> list[str]:
    """SIGKILL and reap every process left below this one (multiprocessing's fork server, its
    ranks and its resource tracker, which run_on_ranks reuses, excepted); the command lines of
    those that were still running (not the zombies: exited orphans reparented here)."""
    from multiprocessing import forkserver, resource_tracker

    from distrun.testing import descendants

    ours = (getattr(forkserver._forkserver, "_forkserver_pid", None),
            getattr(resource_tracker._resource_tracker, "_pid", None))
    spared = {p for pid in ours if pid for p in (pid, *descendants(pid))}

    def below() -> list[int]:
        return [pid for pid in descendants(os.getpid()) if pid not in spared]

    running = []
    for pid in below():
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rpartition(")")[2].split()[0] == "Z":
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                running.append(cmdline.read().replace(b"\0", b" ").decode(errors="replace")[:100])
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while (left := below()) and time.monotonic() < deadline:  # reap ours, orphans included
        for pid in left:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        time.sleep(0.02)
    return running


def _say_reaped(what: str) -> None:
    """Kill what a launch left running, and say so: a leftover would load the next launch."""
    for name in _reap():
        print(f"    {what}: left running after the launch, killed: {name}", flush=True)


def _launch(cmd: list[str], cwd: str | Path, env: dict[str, str], timeout: float,
            what: str) -> bool:
    """Run one launch to its end; False (said, with its stderr's tail) when it failed."""
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"    {what}: timed out after {timeout:.0f} s", flush=True)
        return False
    finally:
        _say_reaped(what)
    if proc.returncode != 0:
        print(f"    {what}: exit {proc.returncode}\n{proc.stderr[-1500:]}", flush=True)
    return proc.returncode == 0


def _color(label: str) -> str:
    """distrun blue (its memory tier green), the main anchor orange, the disk grey."""
    if label.startswith("distrun"):
        return "tab:green" if "memory" in label else "tab:blue"
    return "tab:gray" if label.startswith("dd") else "tab:orange"


def _plot(path: Path, title: str, xlabel: str, grid: list[list[Panel]], logx: bool,
          logy: bool = False, xticks: Sequence[float] | None = None) -> None:
    """One PNG of a grid of panels sharing the x axis; distrun's lines solid, anchors dashed."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    rows, cols = len(grid), len(grid[0])
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols + 0.6, 3.4 * rows + 0.6),
                             squeeze=False)
    for r, row in enumerate(grid):
        for c, (name, ylabel, lines) in enumerate(row):
            ax = axes[r][c]
            for label, xs, ys in lines:
                points = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
                if not points:
                    continue
                ax.plot([x for x, _ in points], [y for _, y in points], marker="o",
                        linestyle="-" if label.startswith("distrun") else "--",
                        color=_color(label), label=label)
            if logx:
                ax.set_xscale("log")
            if logy:
                ax.set_yscale("log")
            else:  # from 0: the gap between the lines reads as their ratio
                ax.set_ylim(bottom=0)
            if xticks is not None:  # the measured sizes, written out, not powers of ten
                ax.xaxis.set_minor_locator(NullLocator())
                ax.set_xticks(list(xticks), labels=[f"{x:.2g}" for x in xticks])
            ax.set_title(name, fontsize=10)
            if r == rows - 1:
                ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"  plot: {path}", flush=True)


# -- checkpoint -------------------------------------------------------------------------------

#: the checkpoint curve's sides: the anchors first
CKPT_METHODS = ("dd", "dcp", "distrun")
CKPT_LAYERS = 16
#: what a rank holds besides its shard (torch, gloo, DCP's buffers), for the memory check
RANK_OVERHEAD = 0.6 * GB


def _ckpt_shape(gb: float) -> tuple[int, int]:
    """(layers, dim) of a float32 model of about ``gb`` GB: 16 square weights, dim a multiple of
    64 (so 1, 2, 4 or 8 ranks split the rows evenly)."""
    dim = max(64, round(math.sqrt(gb * GB / CKPT_LAYERS / 4) / 64) * 64)
    return CKPT_LAYERS, dim


def _fresh(paths: Sequence[str]) -> None:
    """Before a save: delete that method's previous files, flush every dirty page and let the
    disk go idle, so no method pays for another's deletes or writeback."""
    import torch.distributed as dist

    for path in paths:
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    os.sync()
    dist.barrier()
    time.sleep(0.2)


def _uncache(rank: int, root: str) -> None:
    """Before a load: drop every scratch file from the page cache (they are fsynced, so their
    pages are clean and DONTNEED evicts them), so each load reads the disk."""
    import torch.distributed as dist

    os.sync()
    if rank == 0:  # the page cache is the machine's: one rank does it for all
        for folder, _, names in os.walk(root):
            for name in names:
                fd = os.open(os.path.join(folder, name), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
    dist.barrier()
    time.sleep(0.2)


def _dd_read(path: str, block: int) -> None:
    """``dd iflag=direct`` of ``path`` into /dev/null: the disk's read speed."""
    subprocess.run(["dd", f"if={path}", "of=/dev/null", f"bs={block}", "iflag=direct",
                    "status=none"], check=True)


def checkpoint_rank(rank: int, world: int, root: str, layers: int, dim: int,
                    repeats: int) -> dict[str, Any]:
    """One rank of a checkpoint point (under run_on_ranks): each method's save and load time per
    round, this rank's extra RSS during the saves and peak RSS, and whether the loads were
    bit-exact."""
    import resource
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from distrun_safetensors.load import load
    from distrun_safetensors.save import Checkpointer

    warnings.filterwarnings("ignore")  # DCP's notes about its planner, not about the figures
    model = checkpoint.make_model(layers, dim, init_device_mesh("cpu", (world,)))
    state = model.state_dict()  # DCP's view: the same DTensors
    with torch.no_grad():
        # the storage of each weight (DTensor parameters)
        shards = [p.to_local() for p in model.parameters()]  # type: ignore[attr-defined]
    mine = sum(t.numel() * t.element_size() for t in shards)
    # dd's block: 64M, or this rank's bytes rounded up to 1 MiB (O_DIRECT) when fewer, so that
    # dd writes about the bytes the others write, not a whole 64M block
    block = min(checkpoint.DD_BLOCK, -(-mine // MIB) * MIB)
    dd_file = os.path.join(root, f"dd-{rank}.bin")
    folder = {"dcp": os.path.join(root, "dcp"), "distrun": os.path.join(root, "distrun")}
    out: dict[str, Any] = {"save": {m: [] for m in CKPT_METHODS},
                           "load": {m: [] for m in CKPT_METHODS},
                           "rss": dict.fromkeys(CKPT_METHODS, 0), "bytes": mine}

    def save(method: str, step: int) -> None:
        if method == "dd":
            out["dd_bytes"] = checkpoint.dd_write(dd_file, mine, block)
        elif method == "dcp":
            dcp.save(state, checkpoint_id=folder["dcp"])
        else:
            saver = Checkpointer(folder["distrun"], keep_last=1)
            saver.save(step, model)
            saver.wait()

    def restore(method: str, step: int) -> None:
        if method == "dd":
            _dd_read(dd_file, block)
        elif method == "dcp":
            dcp.load(state, checkpoint_id=folder["dcp"])
        else:
            load(os.path.join(folder["distrun"], f"step-{step}"), model)

    exact = True
    with torch.no_grad():
        for r in range(repeats):
            order = _rotated(CKPT_METHODS, r)
            for method in order:
                # each rank deletes its own dd file; rank 0 the shared checkpoint folders
                _fresh([dd_file] if method == "dd" else [folder[method]] if rank == 0 else [])
                with checkpoint.PeakRSS() as mem:
                    seconds = checkpoint.timed(lambda m=method, n=r + 1: save(m, n))
                out["save"][method].append(seconds)
                out["rss"][method] = max(out["rss"][method], mem.extra)
            for method in order:
                for t in shards:  # a load that did nothing would not pass the check below
                    t.zero_()
                _uncache(rank, root)
                out["load"][method].append(
                    checkpoint.timed(lambda m=method, n=r + 1: restore(m, n)))
                if method != "dd":
                    exact = exact and all(bool(t.eq(i + 0.5).all())
                                          for i, t in enumerate(shards))
            for i, t in enumerate(shards):  # the values make_model wrote, for the next saves
                t.fill_(i + 0.5)
    out["exact"] = exact
    out["maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def _slowest(results: list[dict[str, Any]], kind: str, method: str) -> float:
    """The median over rounds of the slowest rank's time."""
    rounds = zip(*(r[kind][method] for r in results), strict=True)
    return statistics.median(max(times) for times in rounds)


def checkpoint_point(gb: float, world: int, repeats: int, scratch: str | None
                     ) -> dict[str, Any] | None:
    """Measure one (size, ranks) point; None when it was skipped or failed (said)."""
    from distrun.testing import run_on_ranks

    layers, dim = _ckpt_shape(gb)
    total = layers * dim * dim * 4
    # the model once, DCP's load buffers (two copies of a rank's largest tensor), the processes
    if not _fits(total * (1 + 2 / layers) + world * RANK_OVERHEAD,
                 f"{total / GB:.2f} GB on {world} rank(s)"):
        return None
    root = tempfile.mkdtemp(prefix="distrun-curve-ckpt-", dir=scratch)
    started = time.perf_counter()
    try:
        res = run_on_ranks(checkpoint_rank, world, root, layers, dim, repeats,
                           init_process_group=True, timeout=3600)
    except AssertionError as exc:  # a rank failed: its traceback
        print(f"  {total / GB:.2f} GB on {world} rank(s) failed:\n{exc}", flush=True)
        return None
    finally:
        shutil.rmtree(root, ignore_errors=True)
    row: dict[str, Any] = {"gb": total / GB, "ranks": world, "exact": all(r["exact"] for r in res),
                           "ram": sum(r["maxrss"] for r in res), "layers": layers, "dim": dim,
                           "seconds": time.perf_counter() - started}
    written = {"dd": sum(r["dd_bytes"] for r in res), "dcp": total, "distrun": total}
    for kind in ("save", "load"):
        row[kind] = {m: written[m] / GB / _slowest(res, kind, m) for m in CKPT_METHODS}
    row["rss"] = {m: max(r["rss"][m] for r in res) for m in CKPT_METHODS}
    return row


def _ckpt_line(row: dict[str, Any]) -> str:
    s, ld, rss = row["save"], row["load"], row["rss"]
    return (f"{row['gb']:6.3f} {row['ranks']:>5} | {s['dd']:6.2f} {s['dcp']:6.2f} "
            f"{s['distrun']:7.2f} {s['distrun'] / s['dd']:5.2f}x {s['distrun'] / s['dcp']:5.2f}x | "
            f"{ld['dd']:6.2f} {ld['dcp']:6.2f} {ld['distrun']:7.2f} "
            f"{ld['distrun'] / ld['dd']:5.2f}x {ld['distrun'] / ld['dcp']:5.2f}x | "
            f"{rss['dcp'] / MIB:6.0f} {rss['distrun'] / MIB:7.0f} "
            f"{_fmt(_ratio(rss['distrun'], rss['dcp']), '.2f', 5)}x | "
            f"{row['ram'] / GB:5.1f} {'yes' if row['exact'] else 'NO':>5} {row['seconds']:5.0f}")


def curve_checkpoint(sizes: list[float], ranks: list[int], repeats: int, scratch: str | None,
                     img: Path) -> bool:
    """Save/load GB/s and extra RSS against model size, per rank count; table and plot."""
    print(f"checkpoint: float32 model of {CKPT_LAYERS} square weights sharded by rows over the "
          f"ranks (gloo, CPU); medians of {repeats} round(s), slowest rank; loads from the disk "
          "(page cache dropped)", flush=True)
    print(f"{'':13}| {'save GB/s':^35} | {'load GB/s (dd: iflag=direct)':^35} | "
          f"{'save extra RSS MB':^21} | {'RAM':>5} {'bit-':>5} {'time':>5}")
    print(f"{'GB':>6} {'ranks':>5} | {'dd':>6} {'DCP':>6} {'distrun':>7} {'/dd':>6} {'/DCP':>6} | "
          f"{'dd':>6} {'DCP':>6} {'distrun':>7} {'/dd':>6} {'/DCP':>6} | {'DCP':>6} "
          f"{'distrun':>7} {'/DCP':>6} | {'GB':>5} {'exact':>5} {'s':>5}", flush=True)
    rows: list[dict[str, Any]] = []
    for gb in sizes:
        for world in ranks:
            row = checkpoint_point(gb, world, repeats, scratch)
            if row is not None:
                rows.append(row)
                print(_ckpt_line(row), flush=True)
    print("  /dd, /DCP: distrun's figure over the anchor's (GB/s: higher is better for distrun; "
          "RSS: lower); RAM GB: the sum of the ranks' peak RSS (shared pages counted per rank)")
    if rows:
        xs = sorted({row["gb"] for row in rows})
        labels = {"save": {"dd": "dd oflag=direct", "dcp": "DCP save", "distrun": "distrun save"},
                  "load": {"dd": "dd iflag=direct", "dcp": "DCP load", "distrun": "distrun load"},
                  "rss": {"dcp": "DCP save", "distrun": "distrun save"}}
        titles = {"save": "save GB/s", "load": "load GB/s (from disk)",
                  "rss": "peak extra RSS per rank, MB"}
        grid = []
        for kind in ("save", "load", "rss"):
            panels = []
            for world in ranks:
                mine = {row["gb"]: row for row in rows if row["ranks"] == world}
                lines = [(label, xs, [(mine[x][kind][m] / (MIB if kind == "rss" else 1))
                                      if x in mine else None for x in xs])
                         for m, label in labels[kind].items()]
                panels.append((f"{world} rank(s)", titles[kind], lines))
            grid.append(panels)
        _plot(img / "curve-checkpoint.png", "checkpoint: distrun-safetensors vs DCP and dd",
              "model size, GB (float32, sharded over the ranks)", grid, logx=True,
              xticks=xs)
    return len(rows) == len(sizes) * len(ranks)


# -- restart ----------------------------------------------------------------------------------

#: recovery.py's sides compared here: the anchor, then distrun's loop
RESTART_SIDES = ("torchrun-fix", "distrun", "distrun-memory")
RESTART_LABELS = {"torchrun-fix": "torchrun + torch.save", "distrun": "distrun + safetensors",
                  "distrun-memory": "distrun + memory tier"}
#: the run: checkpoint at step 4 only, rank 1 dies at the end of step 5, both resume at 5
RESTART_ENV = {"BENCH_KILL_STEP": "5", "BENCH_STEPS": "6", "BENCH_CKPT_EVERY": "4",
               "BENCH_PG_TIMEOUT": "600"}


def _mlp_shape(params: int) -> tuple[int, int]:
    """(width, depth) of recovery.py's MLP with about ``params`` parameters: the widest power
    of two up to 4096 whose square fits four times, then as many square layers as it takes."""
    width = 64
    while width < 4096 and (2 * width) ** 2 * 4 <= params:
        width *= 2
    return width, max(1, round(params / (width * width)))


def _mlp_params(width: int, depth: int) -> int:
    return 9 * width + depth * (width * width + width) + width + 1


def _resumed_at(out: Path) -> int | None:
    """The first step the restarted attempt trained (5: it resumed from step 4's checkpoint)."""
    with contextlib.suppress(FileNotFoundError):
        steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
        after = [s["step"] for s in steps if s["attempt"] > 0]
        return min(after) if after else None
    return None


def curve_restart(params: list[int], repeats: int, img: Path) -> bool:
    """Failure -> first resumed step against the parameter count; table and plot."""
    print(f"restart: 2 processes, gloo, AdamW; checkpoint at step "
          f"{RESTART_ENV['BENCH_CKPT_EVERY']}, rank 1 killed at the end of step "
          f"{RESTART_ENV['BENCH_KILL_STEP']}; seconds from the death to the end of the first "
          f"resumed step, medians of {repeats} trial(s) per side", flush=True)
    distrun_cols = f"{'recover':>7} {'detect':>7} {'start':>7} {'load':>6} {'ok':>5} " \
        f"{'resumed':>7} | {'torchrun':>9}"
    print(f"{'params':>12} | {'torchrun-fix + torch.save':^37} | "
          f"{'distrun loop + safetensors':^44} | {'/':>9} | "
          f"{'the same + memory tier':^44} | {'/':>9}")
    print(f"{'':>12} | {'recover':>7} {'detect':>7} {'start':>7} {'ok':>5} {'resumed':>7} | "
          f"{distrun_cols} | {distrun_cols}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="distrun-curve-restart-"))
    rows: list[dict[str, Any]] = []
    index = 0
    try:
        recovery.prepare(work)
        for n in params:
            width, depth = _mlp_shape(n)
            count = _mlp_params(width, depth)
            # 2 ranks x 16 bytes a parameter (weights, gradients, AdamW's two moments), and the
            # memory tier's 12 (weights and moments) three times: two copies and the buffers
            if not _fits(68 * count + 2 * GB, f"{count:,} parameters"):
                continue
            env = dict(RESTART_ENV, BENCH_WIDTH=str(width), BENCH_DEPTH=str(depth))
            trials: dict[str, list[recovery.Trial]] = {side: [] for side in RESTART_SIDES}
            resumed: dict[str, set[int | None]] = {side: set() for side in RESTART_SIDES}
            for r in range(repeats):
                for side in _rotated(RESTART_SIDES, r):
                    index += 1
                    try:
                        trials[side].append(recovery.trial(side, work, index, env,
                                                            timeout=300 + count / 1e6))
                        if trials[side][-1][0]:
                            resumed[side].add(_resumed_at(work / f"{side}-{index}"))
                    finally:
                        _say_reaped(side)
                        shutil.rmtree(work / f"{side}-{index}", ignore_errors=True)
            rows.append(_restart_row(count, trials, resumed))
            print(_restart_line(rows[-1], repeats), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("  recover = detect (death -> the restarted rank 0 exists) + start (-> end of its "
          "first step: imports, process group, load, one step); resumed: the first step trained "
          "after the restart (5 = from step 4's checkpoint); distrun / torchrun: recovery time, "
          "lower is better for distrun")
    if rows:
        xs = [row["params"] for row in rows]
        panels: list[Panel] = [
            (title, "seconds", [(RESTART_LABELS[side], xs, [row[side][key] for row in rows])
                                for side in RESTART_SIDES])
            for key, title in (("recover", "recovery: death -> first resumed step done"),
                               ("detect", "its part: detect + respawn"),
                               ("start", "its part: worker start -> first step done"))]
        _plot(img / "curve-restart.png", "restart after a failure (2 processes, gloo, AdamW)",
              "parameters", [panels], logx=True)
    return all(row[side]["ok"] == repeats for row in rows for side in RESTART_SIDES) and \
        len(rows) == len(params)


def _restart_row(count: int, trials: dict[str, list[recovery.Trial]],
                 resumed: dict[str, set[int | None]]) -> dict[str, Any]:
    row: dict[str, Any] = {"params": count}
    for side, runs in trials.items():
        good = [t for t in runs if t[0]]
        row[side] = {"recover": recovery.median([t[1] for t in good]),
                     "detect": recovery.median([t[2] for t in good]),
                     "start": recovery.median([t[3] for t in good]),
                     "load": recovery.median([t[4] for t in good]), "ok": len(good),
                     "resumed": ",".join(str(s) for s in sorted(resumed[side], key=str))}
    return row


def _restart_line(row: dict[str, Any], repeats: int) -> str:
    t = row["torchrun-fix"]
    line = (f"{row['params']:>12,} | {_fmt(t['recover'], '.2f', 7)} "
            f"{_fmt(t['detect'], '.2f', 7)} {_fmt(t['start'], '.2f', 7)} "
            f"{t['ok']:>2}/{repeats:<2} {t['resumed'] or '-':>7}")
    for side in RESTART_SIDES[1:]:
        d = row[side]
        line += (f" | {_fmt(d['recover'], '.2f', 7)} {_fmt(d['detect'], '.2f', 7)} "
                 f"{_fmt(d['start'], '.2f', 7)} {_fmt(d['load'], '.2f', 6)} "
                 f"{d['ok']:>2}/{repeats:<2} {d['resumed'] or '-':>7} | "
                 f"{_fmt(_ratio(d['recover'], t['recover']), '.2f', 8)}x")
    return line


# -- startup ----------------------------------------------------------------------------------

#: the tiny plain torch DDP script both launchers run: each rank writes its wall-clock time once
#: its step 1 is done (optimizer step included: the first one imports torch._dynamo)
STARTUP_SCRIPT = '''
import datetime, os, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
torch.manual_seed(0)
model = DDP(torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
torch.nn.functional.mse_loss(model(torch.randn(8, 32)), torch.randn(8, 1)).backward()
opt.step()
with open(os.path.join(sys.argv[1], f"rank-{dist.get_rank()}"), "w") as fh:
    fh.write(repr(time.time()))
dist.destroy_process_group()
'''
STARTUP_SIDES = ("torchrun", "distrun")


def _startup(side: str, procs: int, work: Path, script: Path) -> float | None:
    """Seconds from just before the launcher's Popen to the last rank's end of step 1."""
    out = Path(tempfile.mkdtemp(dir=work))
    try:
        launcher = (["torch.distributed.run", "--standalone"] if side == "torchrun"
                    else ["distrun", "run"])
        cmd = [sys.executable, "-m", *launcher, "--nproc-per-node", str(procs), str(script),
               str(out)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        start = time.time()  # wall clock: the ranks' stamps are time.time() too
        if not _launch(cmd, out, env, 600, f"{side} x{procs}"):
            return None
        stamps = [float((out / f"rank-{r}").read_text()) for r in range(procs)]
        return max(stamps) - start
    finally:
        shutil.rmtree(out, ignore_errors=True)


def curve_startup(procs: list[int], repeats: int, img: Path) -> bool:
    """Launcher start -> every rank past step 1, against the process count; table and plot."""
    print(f"startup: launcher start -> every rank has finished step 1 of a tiny DDP script "
          f"(gloo); seconds, medians of {repeats} launch(es) per side", flush=True)
    print(f"{'procs':>5} | {'torchrun':>9} {'distrun':>9} | {'distrun / torchrun':>18}",
          flush=True)
    work = Path(tempfile.mkdtemp(prefix="distrun-curve-startup-"))
    rows: list[dict[str, Any]] = []
    try:
        script = work / "ddp_step.py"
        script.write_text(STARTUP_SCRIPT)
        for n in procs:
            times: dict[str, list[float | None]] = {side: [] for side in STARTUP_SIDES}
            for r in range(repeats):
                for side in _rotated(STARTUP_SIDES, r):
                    times[side].append(_startup(side, n, work, script))
            row = {"procs": n, **{side: recovery.median(times[side]) for side in STARTUP_SIDES},
                   "ok": sum(t is not None for ts in times.values() for t in ts)}
            rows.append(row)
            print(f"{n:>5} | {_fmt(row['torchrun'], '.2f', 8)}s {_fmt(row['distrun'], '.2f', 8)}s "
                  f"| {_fmt(_ratio(row['distrun'], row['torchrun']), '.2f', 17)}x", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("  distrun / torchrun: start-up time, lower is better for distrun")
    if rows:
        xs = [row["procs"] for row in rows]
        lines: list[Line] = [("torchrun --standalone", xs, [row["torchrun"] for row in rows]),
                             ("distrun run", xs, [row["distrun"] for row in rows])]
        _plot(img / "curve-startup.png", "launcher start -> step 1 done on every rank",
              "processes (--nproc-per-node)", [[("start-up", "seconds", lines)]], logx=True,
              xticks=xs)
    return all(row["ok"] == 2 * repeats for row in rows)


# -- step -------------------------------------------------------------------------------------

#: (steps, warm-up) of the model step_overhead.py does not measure itself (~1 s steps here)
STEP_50M = {"full": (20, 4), "quick": (8, 3)}


def curve_step(models: list[str], repeats: int, quick: bool, img: Path) -> bool:
    """distrun's loop vs the hand-written DDP loop, steps/s against the parameter count; table
    and plot."""
    plan = {**(step_overhead.QUICK_PLAN if quick else step_overhead.PLAN),
            "mlp-50M": STEP_50M["quick" if quick else "full"]}
    env = step_overhead.bench_env()
    print(f"step: steps/s, 2 processes, gloo, global batch {step_overhead.GLOBAL_BATCH}, both "
          f"loops alternating in the same processes; medians of {repeats} repeat(s)", flush=True)
    print(f"{'model':<10} {'params':>11} | {'hand DDP':>9} {'distrun':>9} | "
          f"{'distrun / hand':>14}", flush=True)
    rows: list[dict[str, Any]] = []
    for size in models:
        steps, warmup = plan[size]
        params = sum(p.numel() for p in step_overhead.mlp(size).parameters())
        try:
            res = step_overhead.in_process(size, steps, warmup, repeats, env)
        finally:
            _say_reaped(size)
        row = {"model": size, "params": params,
               "torch": recovery.median(res["torch"]) if res else None,
               "distrun": recovery.median(res["distrun"]) if res else None}
        rows.append(row)
        print(f"{size:<10} {params:>11,} | {_fmt(row['torch'], '.1f', 9)} "
              f"{_fmt(row['distrun'], '.1f', 9)} | "
              f"{_fmt(_ratio(row['distrun'], row['torch']), '.3f', 13)}x", flush=True)
    print("  distrun / hand: steps/s, higher is better for distrun")
    if rows:
        xs = [row["params"] for row in rows]
        lines: list[Line] = [("hand-written DDP loop", xs, [row["torch"] for row in rows]),
                             ("distrun loop (--strategy ddp)", xs,
                              [row["distrun"] for row in rows])]
        _plot(img / "curve-step.png", "step rate: distrun's loop vs the hand-written DDP loop",
              "parameters", [[("2 processes, gloo", "steps/s", lines)]], logx=True, logy=True)
    return all(row["torch"] is not None for row in rows)


# -- main -------------------------------------------------------------------------------------

def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _counts(text: str) -> list[int]:
    return [_count(x) for x in text.split(",") if x]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("curves", nargs="*", metavar="CURVE",
                        help=f"which to measure, of {', '.join(CURVES)} (default: all)")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes (checkpoint 0.1,0.5 GB on 1,2 ranks; restart 1M,10M; "
                             "startup 1,2,4), fewer steps, 1 repeat")
    parser.add_argument("--repeats", type=int, help="rounds per point (default 3; --quick 1)")
    parser.add_argument("--sizes", type=_floats, help="checkpoint: model sizes, GB "
                                                      "(default 0.1,0.5,1,2,4)")
    parser.add_argument("--ranks", type=_ints, help="checkpoint: rank counts (default 1,2,4)")
    parser.add_argument("--params", type=_counts,
                        help="restart: parameter counts (default 1M,10M,100M,300M)")
    parser.add_argument("--procs", type=_ints, help="startup: process counts (default 1,2,4,8)")
    parser.add_argument("--models", type=lambda s: [x for x in s.split(",") if x],
                        help="step: step_overhead.py models (default tiny-50K,mlp-5M,mlp-50M)")
    parser.add_argument("--img-dir", type=Path,
                        help="where the PNGs go (default docs/img; with --quick a temp folder)")
    parser.add_argument("--dir", default=None,
                        help="checkpoint: where the scratch files go (default: a temp folder)")
    args = parser.parse_args(argv)
    unknown = set(args.curves) - set(CURVES)
    if unknown:
        parser.error(f"unknown curve(s) {', '.join(sorted(unknown))}: choose from {CURVES}")
    models = args.models or list(step_overhead.PLAN) + ["mlp-50M"]
    if set(models) - set(step_overhead.SIZES):
        parser.error(f"--models: choose from {', '.join(step_overhead.SIZES)}")
    quick = args.quick
    repeats = args.repeats or (1 if quick else 3)
    sizes = args.sizes or ([0.1, 0.5] if quick else [0.1, 0.5, 1, 2, 4])
    ranks = args.ranks or ([1, 2] if quick else [1, 2, 4])
    params = args.params or ([10**6, 10**7] if quick else [10**6, 10**7, 10**8, 3 * 10**8])
    procs = args.procs or ([1, 2, 4] if quick else [1, 2, 4, 8])
    img = args.img_dir or (Path(tempfile.gettempdir()) / "distrun-curves-quick" if quick
                           else REPO / "docs" / "img")
    chosen = [c for c in CURVES if c in (args.curves or CURVES)]  # checkpoint first, always

    _adopt_orphans()
    # SIGTERM ends like Ctrl-C: the finally blocks delete the scratch files and the processes
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    runs: dict[str, Callable[[], bool]] = {
        "checkpoint": lambda: curve_checkpoint(sizes, ranks, repeats, args.dir, img),
        "restart": lambda: curve_restart(params, repeats, img),
        "startup": lambda: curve_startup(procs, repeats, img),
        "step": lambda: curve_step(models, repeats, quick, img),
    }
    failed = []
    try:
        for name in chosen:
            print(f"\n--- {name}", flush=True)
            started = time.perf_counter()
            if not runs[name]():
                failed.append(name)
            print(f"  ({name}: {time.perf_counter() - started:.0f} s)", flush=True)
    finally:
        _reap()
    if failed:
        print(f"\ncurves with points that failed or were skipped: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
