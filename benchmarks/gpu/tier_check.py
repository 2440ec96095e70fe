"""The GPU lane's ``tier`` check (run by inproc.py), in two parts:

- in this process: the memory tier's in-place saves of GPU state (~1 GB) into its files in
  ``/dev/shm``, with the files registered with CUDA (as distrun_safetensors.in_place does)
  against the same saves into pageable files, alternating; the stall of each save (the copy
  the step waits for) against a plain device-to-host copy into pinned buffers; the newest
  save loaded back, bit-equal;
- launched as a user would: ``distrun run examples/tiny_gpt.py`` at ~85M parameters (the
  example's own model, wider and deeper), with and without ``--ckpt-memory-every-n-steps 1``,
  alternated: samples/s of each and the tier's own line on what its saves cost.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import tempfile
import time

from inproc_common import Result, _device, _sync
from lane_procs import PY, REPO, _env, _run

#: saves of each side (the first two take fresh files; from the third on they are recycled)
ROUNDS = 6


def check_tier(res: Result, dry: bool) -> None:
    _saves(res, dry)
    _launches(res, dry)


def _launches(res: Result, dry: bool) -> None:
    """tiny_gpt under ``distrun run``, with and without a memory checkpoint every step."""
    env = dict(_env(dry), TINY_GPT_DIM="32" if dry else "768",
               TINY_GPT_LAYERS="1" if dry else "12")
    steps, rounds = (10, 1) if dry else (60, 2)
    rates: dict[str, list[float]] = {"plain": [], "memory": []}
    entry: dict[str, object] = {"model": f"tiny_gpt dim {env['TINY_GPT_DIM']} layers "
                                f"{env['TINY_GPT_LAYERS']}", "steps": steps, "rates": rates}
    res.figures["launches"] = entry
    for i in range(rounds):
        for kind in ("plain", "memory") if i % 2 == 0 else ("memory", "plain"):
            if res.left() < 30:
                res.note(f"launches: stopped before {kind} {i + 1} (time budget)")
                return
            flags = ["--ckpt-memory-every-n-steps", "1"] if kind == "memory" else []
            with tempfile.TemporaryDirectory(prefix="gpu-lane-tier-run-") as tmp:
                cmd = [PY, "-m", "distrun", "run", "--nproc-per-node", "1", "--max-steps",
                       str(steps), "--log-every-n-steps", "10", "--run-dir", tmp, *flags,
                       str(REPO / "examples" / "tiny_gpt.py")]
                rc, text, _ = _run(cmd, res, cwd=tmp, env=env, limit=90)
            if rc != 0:
                raise SystemExit(f"distrun run examples/tiny_gpt.py ({kind}) failed (exit {rc})")
            got = re.findall(r"\| ([0-9.]+) samples/s", text)
            if got:
                rates[kind].append(float(got[-1]))
            said = [ln for ln in text.splitlines() if "memory tier:" in ln]
            if said:
                entry["tier_said"] = said[0].strip()
            if rates["plain"] and rates["memory"]:
                entry["memory_vs_plain"] = round(
                    statistics.median(rates["memory"]) / statistics.median(rates["plain"]), 3)
            res.write()


def _saves(res: Result, dry: bool) -> None:
    import checkpoint as cb
    import torch

    import distrun_safetensors.in_place as in_place
    from distrun.plugin import join_process_group
    from distrun_safetensors.load import load
    from distrun_safetensors.save import Checkpointer

    dev = _device(dry)
    sync = _sync(dev)
    cuda = dev.type == "cuda"
    layers, dim = (2, 256) if dry else (int(os.environ.get("GPU_LANE_CKPT_LAYERS", "16")), 4096)
    owns = join_process_group(backend="gloo")
    model = cb.make_model(layers, dim).to(dev)
    tensors = list(model.state_dict().values())
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    root = tempfile.mkdtemp(prefix="gpu-lane-tier-", dir=shm)
    res.figures.update({"device": str(dev), "bytes": nbytes, "rounds": ROUNDS, "folder": root})
    sides = {"registered": Checkpointer(os.path.join(root, "registered"), keep_last=1,
                                        async_save=True, in_place=True),
             "pageable": Checkpointer(os.path.join(root, "pageable"), keep_last=1,
                                      async_save=True, in_place=True)}
    stalls: dict[str, list[float]] = {k: [] for k in (*sides, "pinned_copy")}
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in tensors]
    register = in_place._Registered.add
    try:
        for step in range(1, ROUNDS + 1):
            order = list(sides) if step % 2 else list(reversed(sides))
            for name in order:
                saver = sides[name]
                if name == "pageable":  # this side's files are never registered
                    in_place._Registered.add = lambda self, data: None  # type: ignore[method-assign]
                try:
                    sync()
                    saver.save(step, model)
                    saver.wait()
                finally:
                    in_place._Registered.add = register  # type: ignore[method-assign]
                stalls[name].append(saver.stats["stall_s"])
            sync()
            start = time.perf_counter()
            for buf, t in zip(pinned, tensors, strict=True):
                buf.copy_(t, non_blocking=cuda)
            sync()
            stalls["pinned_copy"].append(time.perf_counter() - start)
            print(f"save {step}/{ROUNDS}: " + ", ".join(
                f"{k} {v[-1] * 1e3:.1f} ms" for k, v in stalls.items()), flush=True)
            _figures(res, stalls, nbytes)
        fresh = cb.make_model(layers, dim).to(dev)
        with torch.no_grad():
            for p in fresh.parameters():
                p.zero_()
        load(os.path.join(root, "registered", f"step-{ROUNDS}"), fresh)
        res.figures["load_bit_equal"] = all(
            torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), tensors, strict=True))
        res.write()
        if not res.figures["load_bit_equal"]:
            raise SystemExit("the memory tier's newest save loaded back is not bit-equal")
    finally:
        for saver in sides.values():
            saver.wait()
        shutil.rmtree(root, ignore_errors=True)
        if owns:
            import torch.distributed as dist

            dist.destroy_process_group()


def _figures(res: Result, stalls: dict[str, list[float]], nbytes: int) -> None:
    """Per side: the first save's stall (fresh files; registering them, on the registered
    side) and the median of the recycled ones (the third save on), in ms and GB/s."""
    for name, values in stalls.items():
        steady = values[2:] if name != "pinned_copy" else values
        if not steady:
            continue
        med = statistics.median(steady)
        res.figures[f"{name}_ms"] = round(med * 1e3, 2)
        res.figures[f"{name}_GBps"] = round(nbytes / med / 1e9, 2)
        if name != "pinned_copy":
            res.figures[f"{name}_first_ms"] = round(values[0] * 1e3, 2)
    if "registered_ms" in res.figures and "pinned_copy_ms" in res.figures:
        res.figures["registered_vs_pinned_copy"] = round(
            res.figures["registered_ms"] / res.figures["pinned_copy_ms"], 3)
        if "pageable_ms" in res.figures:
            res.figures["pageable_vs_registered"] = round(
                res.figures["pageable_ms"] / res.figures["registered_ms"], 3)
    res.write()
