"""The GPU lane's ``amp`` check (run by inproc.py): ``bf16-mixed`` and ``16-mixed``
(GradScaler, one step forced to overflow) against a hand-written autocast loop with the same
seed, sample order and model: losses, scales, optimizer steps and final weights.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from inproc_common import Result, _device, _free


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
