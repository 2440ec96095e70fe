"""The batch-size finder: the largest per-rank batch whose training steps fit in memory.

A trial of batch ``b`` takes :data:`TRIAL_STEPS` real steps (the first one allocates the
optimizer's state) with ``b`` samples on every data-parallel rank, and fits when no rank's
peak memory (:mod:`distrun_tune.memory`) went over the budget and none ran out of memory.
The ranks agree on every trial's answer before the next. Batches double from 1 until one does
not fit (or ``--tune-max-batch`` is reached), then a binary search between the last that
fitted and the first that did not finds the largest that fits.

On CUDA with several ranks, a real out-of-memory error on one rank in the middle of a step
leaves the others in the step's collectives: give a ``--tune-max-memory`` below the device's
capacity so trials fail on the budget, not on the allocator.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from distrun.plugin import UsageError
from distrun_tune.finders import agree, ranks, train_step, tune_dir, write_result
from distrun_tune.memory import PeakMemory, format_bytes, parse_bytes
from distrun_tune.options import TuneOptions

__all__ = ["TRIAL_STEPS", "find_batch_size"]

log = logging.getLogger("distrun")

#: optimizer steps per trial
TRIAL_STEPS = 2


def _per_rank(run: Any, value: float) -> list[float]:
    """``value`` of every rank, in rank order (a sum of one-hot vectors)."""
    tensor = torch.zeros(run.world_size, dtype=torch.float64, device=run.device)
    tensor[run.rank] = value
    run.strategy.all_reduce(tensor, "sum")
    return tensor.tolist()


class _Trials:
    def __init__(self, run: Any, budget: int, memory: PeakMemory) -> None:
        self.run, self.budget, self.memory = run, budget, memory
        loader = run.train_loader
        self.dataset = getattr(loader, "dataset", None)
        if self.dataset is None or isinstance(self.dataset, torch.utils.data.IterableDataset) \
                or not hasattr(self.dataset, "__len__"):
            raise UsageError("--tune batch-size needs train_data() to return a map-style "
                             "Dataset (with __len__ and __getitem__), to draw batches of any size")
        self.collate = getattr(run.task, "collate_fn", None) \
            or torch.utils.data.default_collate
        self.done: list[dict[str, Any]] = []

    def _batch(self, size: int) -> Any:
        n, start = len(self.dataset), self.run.strategy.dp_rank * size
        return self.collate([self.dataset[(start + i) % n] for i in range(size)])

    def fits(self, size: int) -> bool:
        run, memory = self.run, self.memory
        memory.reset()
        out_of_memory = False
        try:
            batch = self._batch(size)
            for _ in range(TRIAL_STEPS):
                train_step(run, batch)
            del batch
        except (torch.OutOfMemoryError, MemoryError):
            out_of_memory = True  # (a CPU MemoryError: an allocation the OS refused)
            run.optimizer.zero_grad(set_to_none=True)
        peaks = _per_rank(run, float(memory.peak()))
        ok = agree(run, 0.0 if out_of_memory or max(peaks) > self.budget else 1.0, "min") > 0
        self.done.append({"batch": size, "fits": ok, "peak": max(peaks), "peaks": peaks,
                          "out_of_memory": bool(agree(run, float(out_of_memory), "max"))})
        if run.is_global_zero:
            log.info("batch-size finder: %d per rank %s (peak %s of %s)", size,
                     "fits" if ok else "does not fit", format_bytes(max(peaks)),
                     format_bytes(self.budget))
        return ok


def _budget(run: Any, memory: PeakMemory) -> int:
    if TuneOptions.of(run.config).tune_max_memory:
        return parse_bytes(TuneOptions.of(run.config).tune_max_memory)
    if memory.capacity is not None:
        return memory.capacity
    raise UsageError("--tune batch-size on CPU needs --tune-max-memory (e.g. --tune-max-memory 4GiB): "
                     "a CPU has no out-of-memory error, so a rank's peak RSS under that budget "
                     "is what fits")


def find_batch_size(run: Any) -> dict[str, Any]:
    cap = TuneOptions.of(run.config).tune_max_batch
    memory = PeakMemory(run.device)
    budget = _budget(run, memory)
    trials = _Trials(run, budget, memory)
    baseline = _per_rank(run, float(memory.current()))
    size, fitted, failed = 1, 0, None
    while True:  # doubling
        if not trials.fits(size):
            failed = size
            break
        fitted = size
        if size >= cap:
            break
        size = min(2 * size, cap)
    if failed is not None:  # binary search in (fitted, failed)
        lo, hi = fitted, failed
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if trials.fits(mid) else (lo, mid)
        fitted = lo
    dp = run.strategy.dp_world_size
    result: dict[str, Any] = {
        "finder": "batch-size", "per_rank": fitted, "global": fitted * dp,
        "capped": failed is None, "budget": budget, "baseline": baseline,
        "trials": trials.done, "world_size": run.world_size, "dp_world_size": dp,
        "strategy": run.strategy.name, "device": run.device.type,
    }
    path = write_result(run, "batch_size", result)
    plot = os.path.join(tune_dir(run), "batch_size.png")
    if run.is_global_zero:
        _plot(result, plot)
        if fitted == 0:
            log.warning("warning: batch-size finder: not even 1 sample per rank fits in %s "
                        "(peak %s; raise --tune-max-memory or shrink the model). Curve: %s",
                        format_bytes(budget), format_bytes(trials.done[0]["peak"]), plot)
        else:
            capped = " (the --tune-max-batch cap; more may fit)" if failed is None else ""
            log.info("batch-size finder (%s, %s): %d per rank fits in %s%s: "
                     "--batch-size %d (the global batch over %d data-parallel ranks). "
                     "Curve: %s, numbers: %s", run.strategy.name, ranks(run.world_size), fitted,
                     format_bytes(budget), capped, fitted * dp, dp, plot, path)
    return result


def _plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = 1024**2
    fig, ax = plt.subplots(figsize=(7, 4))
    for fits, color, label in ((True, "tab:green", "fits"), (False, "tab:red", "does not fit")):
        points = [t for t in result["trials"] if t["fits"] == fits]
        ax.scatter([t["batch"] for t in points], [t["peak"] / mib for t in points],
                   color=color, label=label, zorder=3)
    ax.axhline(result["budget"] / mib, color="0.3", linestyle="--", label="budget")
    if result["per_rank"]:
        ax.axvline(result["per_rank"], color="tab:green", linestyle=":",
                   label=f"largest that fits: {result['per_rank']}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch per rank")
    ax.set_ylabel("peak memory per rank (MiB)")
    ax.set_title(f"batch-size finder ({result['strategy']}, {ranks(result['world_size'])}, "
                 f"{result['device']})")
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path + ".tmp.png", dpi=100)
    plt.close(fig)
    os.replace(path + ".tmp.png", path)
