"""distrun-tune's options, read typed with ``TuneOptions.of(config)`` (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from distrun.plugin import PluginOptions, option

#: ``--tune``'s values: the finder to run instead of the fit
FINDERS = ("off", "lr", "batch-size")


@dataclass(frozen=True)
class TuneOptions(PluginOptions, plugin="tune"):
    """The finders' options (``TuneOptions.of(config)``)."""

    tune: str = option(
        "off", "run a finder instead of the fit: 'lr' (LR range test) or 'batch-size' (largest "
        "per-rank batch that fits); `distrun tune lr|batch-size` sets it", choices=FINDERS)
    tune_min_lr: float = option(1e-8, "LR range test: the first learning rate", min=0)
    tune_max_lr: float = option(1.0, "LR range test: the last learning rate", min=0)
    tune_steps: int = option(
        100, "LR range test: optimizer steps from the first to the last learning rate (spaced "
        "exponentially)", min=3)
    tune_max_memory: str = option(
        "", "batch-size finder: the memory a rank may use, e.g. 4GiB or 512MiB (CPU: peak RSS "
        "of the process, required; CUDA: the device's peak reserved memory, default its "
        "capacity)")
    tune_max_batch: int = option(
        4096, "batch-size finder: the largest per-rank batch tried", min=1)
