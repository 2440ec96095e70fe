"""The GPU lane's ``ckpt`` check (run by inproc.py): checkpoint save and load of GPU state
(~1 GB) against DCP and ``torch.save``, and the async save's stall against a plain
device-to-host copy into pinned memory (the pieces of benchmarks/checkpoint.py).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable

from inproc_common import Result, _device, _sync

GB = 1e9


def check_ckpt(res: Result, dry: bool) -> None:
    import shutil

    import checkpoint as cb
    import torch
    import torch.distributed.checkpoint as dcp

    from distrun.plugin import join_process_group
    from distrun_safetensors.load import load
    from distrun_safetensors.save import Checkpointer

    dev = _device(dry)
    sync = _sync(dev)
    cuda = dev.type == "cuda"
    # 16 x 4096 x 4096 float32: ~1.07 GB (GPU_LANE_CKPT_LAYERS=32: ~2.1 GB)
    layers, dim, rounds = (4, 256, 2) if dry else (
        int(os.environ.get("GPU_LANE_CKPT_LAYERS", "16")), 4096, 2)
    owns = join_process_group(backend="gloo")  # DCP and the checkpointer see one rank
    model = cb.make_model(layers, dim).to(dev)
    sd = model.state_dict()
    tensors = list(sd.values())
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    scratch = os.environ.get("GPU_LANE_SCRATCH") or ("/var/tmp" if os.path.isdir("/var/tmp")
                                                     else tempfile.gettempdir())
    root = tempfile.mkdtemp(prefix="gpu-lane-ckpt-", dir=scratch)
    res.figures.update({"device": str(dev), "bytes": nbytes, "layers": layers, "dim": dim,
                        "rounds": rounds, "scratch": root, "scratch_fs": _fs_type(root)})
    res.write()
    try:
        saver = Checkpointer(os.path.join(root, "ours"), keep_last=1)
        background = Checkpointer(os.path.join(root, "async"), keep_last=1, async_save=True)
        pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in tensors]
        times: dict[str, list[float]] = {}
        stalls: list[float] = []

        def torch_save() -> None:
            path = os.path.join(root, "torch.pt")
            torch.save(sd, path)
            with open(path, "rb+") as fh:
                os.fsync(fh.fileno())

        def pinned_copy() -> None:
            for buf, t in zip(pinned, tensors, strict=True):
                buf.copy_(t, non_blocking=cuda)

        def direct() -> None:
            cb.dd_write(os.path.join(root, "dd.bin"), nbytes)

        def timed(fn: Callable[[], None]) -> float:
            sync()
            start = time.perf_counter()
            fn()
            sync()
            return time.perf_counter() - start

        for step in range(1, rounds + 1):
            methods = (("dd", direct),
                       ("ours_save", lambda step=step: saver.save(step, model)),
                       ("torch_save", torch_save),
                       ("dcp_save", lambda: dcp.save(sd, checkpoint_id=os.path.join(root, "dcp"))),
                       ("pinned_copy", pinned_copy),
                       ("async_stall", lambda step=step: background.save(step, model)))
            for key, fn in methods:
                os.sync()
                time.sleep(0.1)
                try:
                    with cb.PeakRSS() as mem:
                        seconds = timed(fn)
                except Exception as exc:  # dd on a folder without O_DIRECT: said, not fatal
                    if key != "dd":
                        raise
                    res.note(f"dd oflag=direct failed here ({type(exc).__name__}); no disk "
                             "reference figure")
                    continue
                if key == "ours_save":
                    saver.wait()
                if key == "async_stall":
                    background.wait()
                    stalls.append(background.stats["stall_s"])
                    if step == 1:
                        continue  # the first async save allocates its pinned buffers
                times.setdefault(key, []).append(seconds)
                res.figures[f"{key}_extra_rss"] = max(res.figures.get(f"{key}_extra_rss", 0),
                                                      mem.extra)
            print(f"round {step}/{rounds}: " + ", ".join(
                f"{k} {v[-1]:.3f} s" for k, v in times.items()), flush=True)
            _ckpt_figures(res, times, nbytes)  # what a time limit would cut short is kept
        fresh = cb.make_model(layers, dim).to(dev)
        with torch.no_grad():
            for p in fresh.parameters():
                p.zero_()
        target = fresh.state_dict()
        latest = os.path.join(root, "ours", f"step-{rounds}")
        loads = (("ours_load", lambda: load(latest, fresh)),
                 ("dcp_load", lambda: dcp.load(target, checkpoint_id=os.path.join(root, "dcp"))),
                 ("torch_load", lambda: torch.load(os.path.join(root, "torch.pt"),
                                                   map_location=dev, weights_only=True)))
        for _ in range(rounds):
            for key, fn in loads:
                times.setdefault(key, []).append(timed(fn))
        load(latest, fresh)
        res.figures["ours_load_bit_equal"] = all(
            torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), tensors, strict=True))
        res.figures["async_stall_s_reported"] = stalls
        _ckpt_figures(res, times, nbytes)
        if not res.figures["ours_load_bit_equal"]:
            raise SystemExit("the checkpoint loaded back is not bit-equal to the saved state")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if owns:
            import torch.distributed as dist

            dist.destroy_process_group()


def _ckpt_figures(res: Result, times: dict[str, list[float]], nbytes: int) -> None:
    """Medians as seconds and GB/s, and the ratios the issue names (ours against the others;
    the async save's stall against a pinned copy of the same bytes)."""
    fig = res.figures
    for key, values in times.items():
        med = statistics.median(values)
        fig[f"{key}_s"] = round(med, 4)
        if key != "async_stall":  # a stall is no transfer rate
            fig[f"{key}_GBps"] = round(nbytes / GB / med, 3)
    if "pinned_copy_s" in fig and "async_stall_s" in fig:
        fig["stall_vs_pinned_copy"] = round(fig["async_stall_s"] / fig["pinned_copy_s"], 3)
        fig["stall_target"] = 1.3
    for other in ("torch_save", "dcp_save"):
        if f"{other}_s" in fig and "ours_save_s" in fig:
            fig[f"ours_save_vs_{other}"] = round(fig[f"{other}_s"] / fig["ours_save_s"], 3)
    if "dcp_load_s" in fig and "ours_load_s" in fig:
        fig["ours_load_vs_dcp_load"] = round(fig["dcp_load_s"] / fig["ours_load_s"], 3)
    res.write()


def _fs_type(path: str) -> str:
    import subprocess

    try:
        out = subprocess.run(["df", "-T", path], capture_output=True, text=True, timeout=10)
        return out.stdout.splitlines()[-1].split()[1]
    except Exception:  # a figure for the report, not worth failing the check for
        return "?"
