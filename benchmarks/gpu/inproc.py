"""The GPU lane's in-process checks, each run by lane.py in a process of its own:

    python benchmarks/gpu/inproc.py CHECK --result FILE --seconds S [--dry]

- ``step``: distrun's loop against a hand-written loop on the same device, in this process,
  alternating, for tiny_gpt (examples/tiny_gpt.py) and a ~100M GPT of the same code, eager
  and with ``--compile``; steps/s timed between two device synchronizations (the end of the
  warm-up step and of the last step), as benchmarks/step_overhead.py does on the CPU;
- ``amp``: ``bf16-mixed`` and ``16-mixed`` (GradScaler, one step forced to overflow) against
  a hand-written autocast loop: losses, scales, optimizer steps and final weights;
- ``ckpt``: checkpoint save and load of GPU state (~1 GB) against DCP and ``torch.save``, and
  the async save's stall against a plain device-to-host copy into pinned memory (the pieces
  of benchmarks/checkpoint.py).

FILE is rewritten after every measurement, so a check stopped at its time limit still leaves
what it measured. ``--dry`` runs the same code on the CPU at the smallest sizes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [os.path.join(REPO, "benchmarks"), os.path.join(REPO, "examples"), HERE]

GB = 1e9


class Result:
    """The check's figures and notes, written to ``path`` after every change."""

    def __init__(self, path: str, seconds: float) -> None:
        self.path = path
        self.deadline = time.monotonic() + seconds
        self.figures: dict[str, Any] = {}
        self.notes: list[str] = []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def note(self, text: str) -> None:
        print(f"[note] {text}", flush=True)
        self.notes.append(text)
        self.write()

    def write(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"figures": self.figures, "notes": self.notes}, fh, indent=1)
        os.replace(tmp, self.path)


def _device(dry: bool) -> Any:
    import torch

    if dry or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", 0)


def _sync(dev: Any) -> Callable[[], None]:
    import torch

    if dev.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def _free() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- step: distrun's loop against a hand-written one ------------------------------------------


def _step_models(dry: bool) -> dict[str, dict[str, Any]]:
    """name -> how to build the model and its token data: (make, X, Y, batch, lr)."""
    import torch
    from tiny_gpt import BLOCK, TinyGPT, corpus

    text = corpus(4000 if dry else 0)
    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([lookup[c] for c in text], dtype=torch.long)

    def windows(n: int, block: int) -> tuple[Any, Any]:
        # n windows every 7 characters, wrapping: the example's data, as many as the steps need
        starts = (torch.arange(n) * 7) % (len(ids) - block - 1)
        idx = starts[:, None] + torch.arange(block + 1)
        chunk = ids[idx]
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    def random_tokens(n: int, block: int, vocab: int) -> tuple[Any, Any]:
        gen = torch.Generator().manual_seed(0)
        chunk = torch.randint(0, vocab, (n, block + 1), generator=gen)
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    tiny_dims = dict(dim=32, layers=1) if dry else dict(dim=64, layers=2)
    models = {
        "tiny_gpt": dict(make=lambda: TinyGPT(len(chars), heads=4, **tiny_dims),
                         data=lambda n: windows(n, BLOCK), batch=8 if dry else 64, lr=3e-3),
    }
    if not dry:
        models["gpt_100m"] = dict(
            make=lambda: TinyGPT(8192, dim=768, layers=12, heads=12, block=256),
            data=lambda n: random_tokens(n, 256, 8192), batch=16, lr=3e-4)
    return models


def _hand_loop(spec: dict[str, Any], X: Any, Y: Any, steps: int, warmup: int, compiled: bool,
               dev: Any, log_every: int) -> float:
    """The baseline, nanoGPT-style: index the batch, pin, copy, forward, backward, step;
    the loss printed every ``log_every`` steps. Steps/s after the warm-up."""
    import torch
    import torch.nn.functional as F

    from distrun.plugin import epoch_permutation, seed_everything

    sync = _sync(dev)
    seed_everything(0)
    model = spec["make"]().to(dev)
    if compiled:
        model.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"])
    batch = spec["batch"]
    order = epoch_permutation(0, 0, len(X))  # distrun's order of the same samples
    start = 0.0
    for step in range(1, steps + 1):
        idx = order[(step - 1) * batch:step * batch]
        x, y = X[idx], Y[idx]
        if dev.type == "cuda":
            x = x.pin_memory().to(dev, non_blocking=True)
            y = y.pin_memory().to(dev, non_blocking=True)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % log_every == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        if step == warmup:
            sync()
            start = time.perf_counter()
    sync()
    return (steps - warmup) / (time.perf_counter() - start)


def _distrun_loop(spec: dict[str, Any], X: Any, Y: Any, steps: int, warmup: int,
                  compiled: bool, dev: Any, log_every: int, nonfinite: str) -> float:
    """``distrun.Trainer(...).fit(task)`` on the same model, data, order, seed and optimizer,
    logging every ``log_every`` steps; ``nonfinite``: its ``--nonfinite-loss`` policy."""
    import torch
    import torch.nn.functional as F

    import distrun
    from distrun.plugin import hookimpl

    sync = _sync(dev)

    class Timer:
        start = end = 0.0

        @hookimpl
        def distrun_on_step_end(self, run: Any, step: int) -> None:
            if step == warmup:
                sync()
                self.start = time.perf_counter()
            elif step == steps:
                sync()
                self.end = time.perf_counter()

    class StepTask(distrun.Task):
        def configure_model(self) -> Any:
            return spec["make"]()

        def configure_optimizer(self, params: Any) -> Any:
            return torch.optim.AdamW(params, lr=spec["lr"])

        def train_data(self) -> Any:
            return torch.utils.data.TensorDataset(X, Y)

        def training_step(self, model: Any, batch: Any) -> Any:
            x, y = batch
            return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

    timer = Timer()
    with tempfile.TemporaryDirectory(prefix="gpu-lane-step-") as tmp:
        trainer = distrun.Trainer(
            plugins=(timer,), batch_size=spec["batch"], max_steps=steps, max_epochs=1, seed=0,
            summary=False, run_dir=os.path.join(tmp, "run"), log_every_n_steps=log_every,
            compile=compiled, nonfinite_loss=nonfinite, device=dev.type)
        try:
            trainer.fit(StepTask())
        finally:
            trainer.close()
    return (steps - warmup) / (timer.end - timer.start)


def check_step(res: Result, dry: bool) -> None:
    import step_overhead as so
    import torch

    os.environ["DISTRUN_BLOCK_PLUGINS"] = so.BLOCKED  # the add-on loggers, as on the CPU
    dev = _device(dry)
    torch.set_float32_matmul_precision("high")  # TF32 matmuls in both loops alike
    log_every = so.LOG_EVERY
    models = _step_models(dry)
    # (model, compiled, steps, warm-up steps, repeats); each repeat runs every loop once.
    # Compiled, the third loop (the per-step loss.item() left out) is left out: each run of
    # a compiled model traces it again, and the eager runs say what that item costs
    plan = [("tiny_gpt", False, 3, 1, 1)] if dry else [
        ("tiny_gpt", False, 400, 50, 3), ("gpt_100m", False, 60, 10, 3),
        ("tiny_gpt", True, 300, 60, 2), ("gpt_100m", True, 60, 20, 2)]
    if dry:
        res.note("dry: tiny_gpt eager on the CPU only, 3 steps; --compile and gpt_100m are "
                 "left to the GPU run")
    all_loops = ("torch", "distrun", "distrun_nonfinite_ignore")
    res.figures.update({"device": str(dev), "log_every": log_every, "target": 0.99,
                        "loops": {"torch": "hand-written loop", "distrun": "distrun.Trainer, "
                                  "defaults", "distrun_nonfinite_ignore": "distrun.Trainer, "
                                  "--nonfinite-loss ignore (no per-step loss.item())"}})
    for name, compiled, steps, warmup, repeats in plan:
        key = f"{name}{'_compile' if compiled else ''}"
        need = 60 if compiled else 10  # a compiled model's first run compiles it
        if res.left() < need:
            res.note(f"{key}: not run ({res.left():.0f} s left of the time budget)")
            continue
        if compiled:
            # dynamo's frame state from the other model's shapes would make this one's compile
            # dynamic (automatic dynamic shapes): each model compiles static, as alone
            torch._dynamo.reset()
        spec = models[name]
        X, Y = spec["data"](steps * spec["batch"])
        params = sum(p.numel() for p in spec["make"]().parameters())
        loops = all_loops[:2] if compiled else all_loops
        rates: dict[str, list[float]] = {k: [] for k in loops}
        entry: dict[str, Any] = {"params": params, "steps": steps, "warmup": warmup,
                                 "batch": spec["batch"], "rates": rates}
        res.figures[key] = entry
        began = time.monotonic()
        for i in range(repeats):
            # a repeat after the first costs about what one did (the first compiled one more)
            if i > 0 and res.left() < (time.monotonic() - began) / i + 5:
                res.note(f"{key}: stopped after {i} of {repeats} repeats (time budget)")
                break
            order = loops if i % 2 == 0 else tuple(reversed(loops))
            for loop in order:
                t0 = time.monotonic()
                if loop == "torch":
                    rate = _hand_loop(spec, X, Y, steps, warmup, compiled, dev, log_every)
                else:
                    rate = _distrun_loop(spec, X, Y, steps, warmup, compiled, dev, log_every,
                                         "ignore" if loop.endswith("ignore") else "warn")
                rates[loop].append(rate)
                _free()
                print(f"{key} repeat {i + 1}/{repeats} {loop:<26} {rate:9.1f} steps/s "
                      f"({time.monotonic() - t0:.1f} s)", flush=True)
                _summarize_step(entry)
                res.write()
        entry["seconds"] = round(time.monotonic() - began, 1)
        res.write()
        if res.left() < 10:
            res.note(f"stopped after {key} (time budget)")
            break


def _summarize_step(entry: dict[str, Any]) -> None:
    rates = entry["rates"]
    t = rates["torch"]
    if not t:
        return
    entry["torch_step_ms"] = round(1e3 / statistics.median(t), 4)
    for loop in ("distrun", "distrun_nonfinite_ignore"):
        d = rates.get(loop)
        if not d:
            continue
        entry[f"{loop}_step_ms"] = round(1e3 / statistics.median(d), 4)
        entry[f"{loop}_ratio_best"] = round(max(d) / max(t), 4)
        entry[f"{loop}_ratio_median"] = round(statistics.median(d) / statistics.median(t), 4)
        entry[f"{loop}_extra_us_per_step"] = round(
            1e6 / statistics.median(d) - 1e6 / statistics.median(t), 1)
    if "distrun_ratio_median" in entry:
        entry["meets_target"] = entry["distrun_ratio_median"] >= 0.99


# -- amp: mixed precision against a hand-written autocast loop -------------------------------


def check_amp(res: Result, dry: bool) -> None:
    import torch
    import torch.nn.functional as F

    import distrun
    from distrun.plugin import epoch_permutation, hookimpl, seed_everything
    from distrun_amp.plugin import AMP

    dev = _device(dry)
    steps, batch, overflow = (3, 8, 2) if dry else (12, 32, 5)
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(steps * batch, 256, generator=gen)
    Y = torch.randint(0, 10, (steps * batch,), generator=gen)
    precisions = ["bf16-mixed"] if dev.type == "cpu" else ["bf16-mixed", "16-mixed"]
    if dev.type == "cpu":
        res.note("16-mixed needs CUDA (a GradScaler): only bf16-mixed runs on the CPU")

    class AmpTask(distrun.Task):
        def __init__(self, overflow_step: int) -> None:
            self.overflow_step = overflow_step
            self.calls = 0
            self.losses: list[Any] = []

        def configure_model(self) -> Any:
            return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(),
                                       torch.nn.Linear(1024, 1024), torch.nn.GELU(),
                                       torch.nn.Linear(1024, 10))

        def configure_optimizer(self, params: Any) -> Any:
            return torch.optim.AdamW(params, lr=1e-3)

        def train_data(self) -> Any:
            return torch.utils.data.TensorDataset(X, Y)

        def training_step(self, model: Any, batch: Any) -> Any:
            x, y = batch
            loss = F.cross_entropy(model(x), y)
            self.calls += 1
            if self.calls == self.overflow_step:
                loss = loss * float("inf")  # every gradient inf/nan: the scaler must skip
            self.losses.append(loss.detach().float())
            return loss

    class Scales:
        def __init__(self) -> None:
            self.values: list[float] = []

        @hookimpl
        def distrun_on_step_end(self, run: Any, step: int) -> None:
            amp = run.stash.get(AMP)
            if amp is not None and amp.scaler is not None:
                self.values.append(float(amp.scaler.get_scale()))

    def adam_steps(opt: Any) -> list[float]:
        return sorted({float(s["step"]) for s in opt.state_dict()["state"].values()})

    for precision in precisions:
        fp16 = precision == "16-mixed"
        dtype = torch.float16 if fp16 else torch.bfloat16
        k = overflow if fp16 else 0
        # the hand-written loop: torch's AMP recipe, distrun's seed and sample order
        task = AmpTask(k)
        seed_everything(0)
        model = task.configure_model().to(dev)
        opt = task.configure_optimizer(model.parameters())
        scaler = torch.amp.GradScaler("cuda") if fp16 else None
        order = epoch_permutation(0, 0, len(X))
        hand_scales = []
        for s in range(steps):
            idx = order[s * batch:(s + 1) * batch]
            x, y = X[idx].to(dev), Y[idx].to(dev)
            with torch.autocast(device_type=dev.type, dtype=dtype):
                loss = task.training_step(model, (x, y))
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                hand_scales.append(float(scaler.get_scale()))
            else:
                loss.backward()
                opt.step()
            opt.zero_grad(set_to_none=True)
        hand_losses = [float(v) for v in task.losses]
        hand_weights = {n: p.detach().cpu() for n, p in model.named_parameters()}
        hand_adam = adam_steps(opt)
        # distrun's loop
        dtask, scales = AmpTask(k), Scales()
        with tempfile.TemporaryDirectory(prefix="gpu-lane-amp-") as tmp:
            trainer = distrun.Trainer(plugins=(scales,), precision=precision,
                                      batch_size=batch, max_steps=steps, max_epochs=1, seed=0,
                                      summary=False, run_dir=os.path.join(tmp, "run"),
                                      log_every_n_steps=steps, device=dev.type)
            try:
                run = trainer.fit(dtask)
                weights = {n: p.detach().cpu()
                           for n, p in run.unwrapped_model().named_parameters()}
                run_adam = adam_steps(run.optimizer)
            finally:
                trainer.close()
        losses = [float(v) for v in dtask.losses]
        finite = [(a, b) for a, b in zip(hand_losses, losses, strict=False)
                  if a == a and b == b and abs(a) != float("inf") and abs(b) != float("inf")]
        diff = max((abs(a - b) / max(abs(a), 1e-12) for a, b in finite), default=0.0)
        same_weights = sorted(weights) == sorted(hand_weights) and all(
            torch.equal(weights[n], hand_weights[n]) for n in weights)
        entry = {
            "steps": steps, "overflow_step": k or None,
            "hand_losses": hand_losses, "distrun_losses": losses,
            "losses_bit_equal": hand_losses == losses,
            "max_rel_loss_diff": diff,
            "weights_bit_equal": same_weights,
            "hand_adam_steps": hand_adam, "distrun_adam_steps": run_adam,
            "expected_adam_steps": steps - (1 if k else 0),
        }
        if fp16:
            entry.update({"hand_scales": hand_scales, "distrun_scales": scales.values,
                          "scales_equal": hand_scales == scales.values,
                          "overflow_skipped": run_adam == [float(steps - 1)]
                          and scales.values[k - 1] == scales.values[k - 2] / 2
                          if len(scales.values) >= k and k >= 2 else False})
        entry["matches"] = bool(
            len(losses) == steps and diff <= 1e-3 and run_adam == hand_adam
            and run_adam == [float(entry["expected_adam_steps"])]
            and (not fp16 or (entry["scales_equal"] and entry["overflow_skipped"])))
        res.figures[precision] = entry
        res.write()
        print(f"{precision}: matches {entry['matches']} (losses bit-equal "
              f"{entry['losses_bit_equal']}, max rel diff {diff:.2e}, weights bit-equal "
              f"{same_weights}, adam steps {run_adam} vs {hand_adam})", flush=True)
        _free()
    bad = [p for p in precisions if not res.figures[p]["matches"]]
    if bad:
        raise SystemExit(f"mixed precision differs from the hand-written autocast loop: "
                         f"{', '.join(bad)} (see the figures)")


# -- ckpt: checkpoint save/load speed of GPU state --------------------------------------------


def check_ckpt(res: Result, dry: bool) -> None:
    import shutil

    import checkpoint as cb
    import torch
    import torch.distributed.checkpoint as dcp

    from distrun.plugin import init_single_process_group
    from distrun_safetensors.load import load
    from distrun_safetensors.save import Checkpointer

    dev = _device(dry)
    sync = _sync(dev)
    cuda = dev.type == "cuda"
    # 16 x 4096 x 4096 float32: ~1.07 GB (GPU_LANE_CKPT_LAYERS=32: ~2.1 GB)
    layers, dim, rounds = (4, 256, 2) if dry else (
        int(os.environ.get("GPU_LANE_CKPT_LAYERS", "16")), 4096, 2)
    owns = init_single_process_group("gloo")  # DCP and the checkpointer see one rank
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


CHECKS = {"step": check_step, "amp": check_amp, "ckpt": check_ckpt}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("check", choices=sorted(CHECKS))
    parser.add_argument("--result", required=True, help="the JSON file of figures")
    parser.add_argument("--seconds", type=float, default=120.0, help="this check's budget")
    parser.add_argument("--dry", action="store_true", help="CPU, smallest sizes")
    args = parser.parse_args(argv)
    res = Result(args.result, args.seconds)
    res.write()
    CHECKS[args.check](res, args.dry)
    res.write()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
