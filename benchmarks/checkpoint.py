"""Checkpoint save/load: distrun-safetensors vs torch.save, torch.distributed.checkpoint and the
disk's own speed (`dd oflag=direct`, and a Python write + fsync), side by side on 2 gloo ranks
in one run; then the training stall of an async save against a plain ``copy_`` of its bytes.

    python benchmarks/checkpoint.py            # ~1 GB float32 model (16 x 4096 x 4096)
    python benchmarks/checkpoint.py --quick    # ~64 MB

The model is replicated on both ranks (DDP's layout). Each figure is the slowest rank's time
from a barrier to the end of the operation. Writes are fsynced by every method (torch.save
gets an explicit fsync; DCP's FileSystemWriter syncs by default); before each one the disk is
flushed (`sync`) and left idle a moment, and the scratch files of the others are deleted. Loads read from the page
cache (the files were just written; dropping caches needs root), so they measure the read
path, not the disk. "extra RSS" is the peak resident-set growth during the save, sampled
every 2 ms, against the largest tensor.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import torch

GB = 1e9


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Peak RSS growth over the ``with`` block, sampled in a thread."""

    def __enter__(self) -> PeakRSS:
        self.base = _rss()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def make_model(layers: int, dim: int, mesh: Any = None) -> torch.nn.Module:
    """``layers`` dim x dim float32 weights, layer i filled with i + 0.5. With a 1-D device
    ``mesh`` each weight is a DTensor sharded by rows over it (``Shard(0)``, FSDP's layout):
    this rank allocates only its rows."""
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False, device="meta")
                                  for _ in range(layers)])
    if mesh is None:
        model.to_empty(device="cpu")
    else:
        from torch.distributed.tensor import DTensor, Shard

        rows = -(-dim // mesh.size())  # torch.chunk's split: the last rank may hold fewer
        first = min(dim, mesh.get_local_rank() * rows)
        for layer in model:
            local = torch.empty(min(dim, first + rows) - first, dim)
            layer.weight = torch.nn.Parameter(DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False, shape=(dim, dim), stride=(dim, 1)))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            (p.to_local() if mesh is not None else p).fill_(float(i) + 0.5)
    return model


def timed(fn: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _fsync_write(path: str, tensors: list[torch.Tensor]) -> None:
    with open(path, "wb", buffering=0) as fh:
        for t in tensors:
            fh.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        os.fsync(fh.fileno())


DD_BLOCK = 64 << 20  # dd bs=64M


def dd_write(path: str, nbytes: int, block: int = DD_BLOCK) -> int:
    """``dd if=/dev/zero bs=<block> oflag=direct`` of at least ``nbytes`` (``block``: a multiple
    of 4096, 64M by default); returns the bytes written."""
    count = -(-nbytes // block)
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", f"bs={block}", f"count={count}",
                    "oflag=direct", "status=none"], check=True)
    return count * block


def _settle(root: str, rank: int) -> None:
    """Before each timed method: remove the scratch files of the others, flush every dirty page
    and let the disk go idle, so no method pays for another's deletes or writeback."""
    import torch.distributed as dist

    for name in (f"raw-{rank}.bin", f"dd-{rank}.bin"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(root, name))
    os.sync()
    dist.barrier()
    time.sleep(0.2)


def rank_bench(rank: int, world: int, root: str, layers: int, dim: int,
               repeat: int) -> dict[str, Any]:
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.distributed.tensor  # noqa: F401  (a one-time import every method pays)

    from distrun_safetensors.load import load
    from distrun_safetensors.save import Checkpointer

    warnings.filterwarnings("ignore")  # DCP's notes about its planner, not about the figures
    torch.set_num_threads(1)
    model = make_model(layers, dim)
    sd = model.state_dict()
    out: dict[str, Any] = {}
    times: dict[str, list[float]] = {}
    tensors = list(sd.values())
    mine = tensors[rank::world]  # the same bytes our save writes per rank (an even split)
    mine_bytes = sum(t.numel() * t.element_size() for t in mine)

    saver = Checkpointer(os.path.join(root, "ours"), keep_last=1)
    background = Checkpointer(os.path.join(root, "async"), keep_last=1, async_save=True)
    buffers = [torch.empty_like(t) for t in mine]  # the copy_ baseline: preallocated, reused
    staged: list[int] = []
    written: list[float] = []

    def disk() -> None:
        _fsync_write(os.path.join(root, f"raw-{rank}.bin"), mine)

    def direct() -> None:
        out["dd_bytes"] = dd_write(os.path.join(root, f"dd-{rank}.bin"), mine_bytes)

    def torch_save() -> None:
        if rank == 0:
            path = os.path.join(root, "torch.pt")
            torch.save(sd, path)
            with open(path, "rb+") as fh:
                os.fsync(fh.fileno())

    def copy() -> None:
        for buf, t in zip(buffers, mine, strict=True):
            buf.copy_(t)

    # rounds interleave the methods so load swings of a shared machine hit all of them alike;
    # each figure is the median of the rounds (the async stall: of the rounds after the first,
    # which allocates the buffers)
    for step in range(1, repeat + 1):
        methods = (("dd", direct), ("disk", disk),
                   ("ours_save", lambda step=step: saver.save(step, model)),
                   ("torch_save", torch_save),
                   ("dcp_save", lambda: dcp.save(sd, checkpoint_id=os.path.join(root, "dcp"))),
                   ("copy", copy),
                   ("async_stall", lambda step=step: background.save(step, model)))
        for key, fn in methods:
            _settle(root, rank)
            with PeakRSS() as mem:
                seconds = timed(fn)
            if key == "ours_save":
                saver.wait()  # the pruning of the previous round's checkpoint, not timed
            if key == "async_stall":
                background.wait()
                written.append(background.stats["write_s"])
                staged.append(sum(b.data_ptr() for b in background._staging.values()))
                if step == 1:
                    continue
            times.setdefault(key, []).append(seconds)
            out[key + "_extra_rss"] = max(out.get(key + "_extra_rss", 0), mem.extra)
    out.update({key: statistics.median(values) for key, values in times.items()})
    out["async_write"] = statistics.median(written)
    out["reused"] = len(set(staged)) == 1
    out["mine_bytes"] = mine_bytes
    latest = os.path.join(root, "ours", f"step-{repeat}")

    fresh = make_model(layers, dim)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    target = fresh.state_dict()
    loads = (("ours_load", lambda: load(latest, fresh)),
             ("ours_load_noverify", lambda: load(latest, fresh, verify=False)),
             ("dcp_load", lambda: dcp.load(target, checkpoint_id=os.path.join(root, "dcp"))),
             ("torch_load", lambda: torch.load(os.path.join(root, "torch.pt"),
                                               weights_only=True)))
    for _ in range(repeat):
        for key, fn in loads:
            times.setdefault(key, []).append(timed(fn))
    out.update({key: statistics.median(times[key]) for key, _ in loads})
    load(latest, fresh)
    ok = all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), tensors,
                                               strict=True))
    out["ok"] = ok
    out["largest"] = max(t.numel() * t.element_size() for t in tensors)
    out["bytes"] = sum(t.numel() * t.element_size() for t in tensors)
    dist.barrier()
    return out


def resharded_load(root: str, layers: int, dim: int, repeat: int) -> float:
    """Load the 2-rank checkpoint into one process (no process group)."""
    import torch.distributed.tensor  # noqa: F401

    from distrun_safetensors.load import load

    model = make_model(layers, dim)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        load(os.path.join(root, "ours", f"step-{repeat}"), model)
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="~64 MB model instead of ~1 GB")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp folder)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="rounds (>= 2); each figure is the median")
    args = parser.parse_args(argv)
    if args.repeat < 2:
        parser.error("--repeat must be at least 2 (the first async save allocates its buffers)")
    layers, dim = (16, 1024) if args.quick else (16, 4096)
    root = tempfile.mkdtemp(prefix="distrun-ckpt-bench-", dir=args.dir)
    from distrun.testing import run_on_ranks

    try:
        res = run_on_ranks(rank_bench, 2, root, layers, dim, args.repeat,
                           init_process_group=True, timeout=1800)
        reshard = resharded_load(root, layers, dim, args.repeat)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    r0 = res[0]
    size = r0["bytes"]

    def slowest(key: str) -> float:
        return max(r[key] for r in res)

    def rate(key: str) -> float:
        return size / GB / slowest(key)

    print(f"model: {layers} x {dim}x{dim} float32 = {size / GB:.3f} GB, replicated on 2 ranks "
          f"(largest tensor {r0['largest'] / 1e6:.0f} MB); loads bit-equal: "
          f"{all(r['ok'] for r in res)}; medians of {args.repeat} interleaved rounds")
    dd = sum(r["dd_bytes"] for r in res) / GB / slowest("dd")
    disk = rate("disk")
    print(f"{'save (every byte fsynced)':<46} {'GB/s':>7} {'vs dd':>7} {'vs write':>9}")
    print(f"{'dd if=/dev/zero bs=64M oflag=direct (2 at once)':<46} {dd:7.2f} {1:6.2f}x "
          f"{dd / disk:8.2f}x")
    rows = [("Python write + fsync, same bytes (2 at once)", "disk"),
            ("distrun-safetensors save", "ours_save"), ("torch.save on rank 0 + fsync", "torch_save"),
            ("torch.distributed.checkpoint save", "dcp_save")]
    for label, key in rows:
        print(f"{label[:46]:<46} {rate(key):7.2f} {rate(key) / dd:6.2f}x {rate(key) / disk:8.2f}x")
    ours = rate("ours_save")
    print(f"  ours vs dd: {ours / dd:.2f}x (target >= 0.8); vs torch.save: "
          f"{ours / rate('torch_save'):.2f}x; vs DCP: {ours / rate('dcp_save'):.2f}x")
    stall, copy = slowest("async_stall"), slowest("copy")
    print(f"async save (--ckpt-async), {r0['mine_bytes'] / 1e6:.0f} MB per rank: training paused "
          f"{stall * 1e3:.0f} ms per save; copy_ of the same bytes into preallocated buffers "
          f"{copy * 1e3:.0f} ms: {stall / copy:.2f}x (target <= 1.3); background write "
          f"{slowest('async_write'):.2f} s; buffers reused across saves: "
          f"{all(r['reused'] for r in res)}")
    print(f"{'load (page cache warm)':<46} {'GB/s':>7}")
    for label, key in (("distrun-safetensors load (2 -> 2 ranks)", "ours_load"),
                       ("  same, --no-ckpt-verify (no checksum pass)", "ours_load_noverify"),
                       ("torch.distributed.checkpoint load", "dcp_load"),
                       ("torch.load(weights_only) on each rank", "torch_load")):
        print(f"{label:<46} {rate(key):7.2f}")
    same = max(r["ours_load"] for r in res)
    print(f"{'distrun-safetensors resharded load (2 -> 1)':<46} {size / GB / reshard:7.2f}   "
          f"{reshard / same:.2f}x the same-layout time")
    print(f"  ours load vs DCP load: {rate('ours_load') / rate('dcp_load'):.2f}x with checksums, "
          f"{rate('ours_load_noverify') / rate('dcp_load'):.2f}x without")
    print("peak extra RSS during save, per rank (vs the largest tensor):")
    for key, label in (("ours_save_extra_rss", "distrun-safetensors"),
                       ("torch_save_extra_rss", "torch.save (rank 0 writes)"),
                       ("dcp_save_extra_rss", "DCP")):
        figures = ", ".join(f"rank {i}: {r[key] / 1e6:.0f} MB ({r[key] / r0['largest']:.2f}x)"
                            for i, r in enumerate(res))
        print(f"  {label:<28} {figures}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
