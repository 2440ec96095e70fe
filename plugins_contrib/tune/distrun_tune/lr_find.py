"""The LR range test (Smith, "Cyclical Learning Rates", 2017): train with the learning rate
rising exponentially, one step per rate, and watch the loss.

Each step's loss is the mean over ranks; the curve is smoothed with a bias-corrected
exponential average (weight :data:`BETA`) and the test stops early once the smoothed loss
exceeds :data:`DIVERGE` times its best (it diverged). The suggestion is the rate where the
smoothed loss falls fastest against log(lr), before its minimum, skipping the first tenth of
the points (their average is still warming up). On a quadratic with curvature at most L, plain
SGD diverges above 2/L and falls fastest near 1/L; this suggestion lands in between
(tests/contrib/tune check it: below 2/L, within a factor 4 of 1/L).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

from distrun_tune.finders import agree, ranks, train_step, tune_dir, write_result
from distrun_tune.options import TuneOptions

__all__ = ["BETA", "DIVERGE", "lr_range_test", "smooth", "suggest"]

log = logging.getLogger("distrun")

#: weight of the exponential average of the loss
BETA = 0.98
#: the test stops when the smoothed loss exceeds this many times its best
DIVERGE = 4.0


def smooth(losses: Sequence[float], beta: float = BETA) -> list[float]:
    """Bias-corrected exponential moving average of ``losses``."""
    out, avg = [], 0.0
    for i, loss in enumerate(losses):
        avg = beta * avg + (1 - beta) * loss
        out.append(avg / (1 - beta ** (i + 1)))
    return out


def suggest(lrs: Sequence[float], smoothed: Sequence[float]) -> int | None:
    """Index of the steepest fall of ``smoothed`` against log(lr), before its minimum."""
    finite = [i for i, v in enumerate(smoothed) if math.isfinite(v)]
    if not finite:
        return None
    lowest = min(finite, key=lambda i: smoothed[i])
    start = max(1, len(lrs) // 10)
    slopes = {i: (smoothed[i + 1] - smoothed[i - 1]) / math.log(lrs[i + 1] / lrs[i - 1])
              for i in range(start, min(lowest, len(lrs) - 1))}
    slopes = {i: s for i, s in slopes.items() if math.isfinite(s) and s < 0}
    return min(slopes, key=lambda i: slopes[i]) if slopes else None


def _batches(run: Any) -> Iterator[Any]:
    """The training data over and over (a new epoch's order each pass)."""
    for epoch in itertools.count(run.progress.epoch):
        if run.sampler is not None:
            run.sampler.set_epoch(epoch)
        yield from run.train_loader


def lr_range_test(run: Any) -> dict[str, Any]:
    cfg = TuneOptions.of(run.config)
    lo, hi, steps = cfg.tune_min_lr, cfg.tune_max_lr, cfg.tune_steps
    lrs: list[float] = []
    losses: list[float] = []
    best = math.inf
    stopped = "reached --tune-max-lr"
    data = _batches(run)
    for k in range(steps):
        lr = lo * (hi / lo) ** (k / (steps - 1))
        for group in run.optimizer.param_groups:
            group["lr"] = lr
        loss = agree(run, float(train_step(run, next(data)).float().mean()), "mean")
        lrs.append(lr)
        losses.append(loss)
        value = smooth(losses)[-1]
        if not math.isfinite(value) or value > DIVERGE * best:
            stopped = f"the loss diverged at lr {lr:.3g}"
            break
        best = min(best, value)
    smoothed = smooth(losses)
    index = suggest(lrs, smoothed)
    result: dict[str, Any] = {
        "finder": "lr", "suggestion": lrs[index] if index is not None else None,
        "stopped": stopped, "lr": lrs, "loss": losses, "smoothed": smoothed,
        "world_size": run.world_size, "strategy": run.strategy.name,
    }
    path = write_result(run, "lr_find", result)
    plot = os.path.join(tune_dir(run), "lr_find.png")
    if run.is_global_zero:
        _plot(result, plot)
        if index is None:
            log.warning("warning: LR range test: no suggestion, the loss never fell over "
                        "%d steps (%s); widen the range with --tune-min-lr/--tune-max-lr "
                        "(curve: %s)", len(lrs), stopped, plot)
        else:
            log.info("LR range test (%s, %s): suggested lr %.3g, where the loss "
                     "falls fastest; %s. Curve: %s, numbers: %s", run.strategy.name,
                     ranks(run.world_size), lrs[index], stopped, plot, path)
    return result


def _plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(result["lr"], result["loss"], color="0.7", linewidth=1, label="loss")
    ax.plot(result["lr"], result["smoothed"], label="smoothed")
    if result["suggestion"] is not None:
        ax.axvline(result["suggestion"], color="tab:red", linestyle="--",
                   label=f"suggested {result['suggestion']:.3g}")
    ax.set_xscale("log")
    smoothed = result["smoothed"]
    finite = [i for i, v in enumerate(smoothed) if math.isfinite(v)]
    if finite:  # up to the lowest point: the diverged tail would flatten the rest
        lowest = min(finite, key=lambda i: smoothed[i])
        head = [v for v in (*result["loss"][:lowest + 1], *smoothed[:lowest + 1])
                if math.isfinite(v)]
        ax.set_ylim(min(0.0, *head), 1.2 * max(head))
    ax.set_xlabel("learning rate")
    ax.set_ylabel("loss")
    ax.set_title(f"LR range test ({result['strategy']}, {ranks(result['world_size'])})")
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path + ".tmp.png", dpi=100)
    plt.close(fig)
    os.replace(path + ".tmp.png", path)
