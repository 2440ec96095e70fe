"""The GPU lane's ``step`` check (run by inproc.py): distrun's loop against a hand-written
loop on the same device, in one process, alternating, for tiny_gpt (examples/tiny_gpt.py) and
a ~100M GPT of the same code, eager and with ``--compile``; steps/s timed between two device
synchronizations (the end of the warm-up step and of the last step), as
benchmarks/step_overhead.py does on the CPU.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any

from inproc_common import Result, _device, _free, _sync


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
                # distrun's loop ends with a checkpoint (1.2 GB at 100M): its pages go to the
                # disk now, not during the next loop's timed steps
                os.sync()
                print(f"{key} repeat {i + 1}/{repeats} {loop:<26} {rate:9.1f} steps/s "
                      f"({time.monotonic() - t0:.1f} s)", flush=True)
                _summarize_step(entry)
                res.write()
        entry["seconds"] = round(time.monotonic() - began, 1)
        res.write()
        if res.left() < 10:
            res.note(f"stopped after {key} (time budget)")
            break
    if res.left() > 15:
        _sync_census(res, dry)


def _sync_census(res: Result, dry: bool, steps: int = 60) -> None:
    """The host synchronizations of each loop over ``steps`` steps of tiny_gpt (torch's
    ``set_sync_debug_mode``), and where the most frequent ones come from: distrun's loop
    should add none per step beyond ``--nonfinite-loss``'s ``loss.item()`` (the first GPU
    run: one per step with the default ``warn``, none with ``ignore``; three per log step
    against the hand-written loop's one)."""
    import collections
    import traceback
    import warnings

    import torch

    dev = _device(dry)
    if dev.type != "cuda":
        res.note("syncs: counted on a GPU only")
        return
    spec = _step_models(dry)["tiny_gpt"]
    X, Y = spec["data"](steps * spec["batch"])
    census: dict[str, Any] = {"steps": steps}
    res.figures["syncs"] = census
    seen: collections.Counter[str] = collections.Counter()

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None,
             line: Any = None) -> None:
        if "synchroniz" in str(message):
            frames = [f"{os.path.basename(f.filename)}:{f.lineno}"
                      for f in traceback.extract_stack()[:-2]]
            seen[" < ".join(reversed(frames[-5:]))] += 1

    loops = {"torch": lambda: _hand_loop(spec, X, Y, steps, 5, False, dev, 10),
             "distrun": lambda: _distrun_loop(spec, X, Y, steps, 5, False, dev, 10, "warn"),
             "distrun_nonfinite_ignore": lambda: _distrun_loop(spec, X, Y, steps, 5, False,
                                                               dev, 10, "ignore")}
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        for name, loop in loops.items():
            seen.clear()
            torch.cuda.set_sync_debug_mode(1)
            try:
                loop()
            finally:
                torch.cuda.set_sync_debug_mode(0)
            census[name] = {"total": sum(seen.values()),
                            "most": [[n, where] for where, n in seen.most_common(4)]}
            res.write()


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
