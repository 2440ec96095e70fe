"""Lightning's debugging switches: ``limit_train_batches``, ``limit_val_batches``,
``overfit_batches``, ``fast_dev_run``, the sanity validation pass (``num_sanity_val_steps``)
and ``deterministic``."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from distrun._spec.errors import UsageError
from distrun._spec.stash import StashKey

__all__ = ["SANITY_BATCHES", "apply_fast_dev_run", "sanity_check", "set_deterministic",
           "train_limit", "val_limit"]

#: set while the sanity pass runs: the validation batches the core's validation takes
SANITY_BATCHES: StashKey[int] = StashKey("sanity_val_batches")

log = logging.getLogger("distrun")


def apply_fast_dev_run(config: Any) -> Any:
    """``fast_dev_run=N``: one epoch of N training and N validation batches, no sanity pass
    (checkpoint plugins read ``config.fast_dev_run`` and save nothing)."""
    n = config.fast_dev_run
    if not n:
        return config
    from distrun._config.run_config import with_values

    return with_values(config, source="fast_dev_run", max_epochs=1, max_steps=n,
                       limit_train_batches=n, limit_val_batches=n, num_sanity_val_steps=0)


def train_limit(config: Any) -> int:
    """Micro-batches per epoch the training sampler stops at (0: the whole epoch)."""
    if config.overfit_batches and config.limit_train_batches:
        raise UsageError("--overfit-batches and --limit-train-batches both limit the training "
                         "batches; give one")
    return config.overfit_batches or config.limit_train_batches


def val_limit(config: Any) -> int:
    return config.limit_val_batches


def overfit_val_data(run: Any, train: Any) -> Any:
    """The validation data of ``--overfit-batches N``: the N batches training sees."""
    n = run.config.overfit_batches * run.config.batch_size
    return torch.utils.data.Subset(train, range(min(n, len(train))))


def sanity_check(run: Any) -> None:
    """Run the first ``num_sanity_val_steps`` validation batches before training: a broken
    ``validation_step`` fails now, not after an epoch. Nothing is logged and no hook sees it;
    the random state is as it was (the run trains as it would without it)."""
    n = run.config.num_sanity_val_steps
    if not n or run.val_loader is None or not hasattr(run.val_loader, "batch_sampler"):
        return  # (a plain iterable may hold different counts on each rank: not cut short)
    from distrun._train.rng import rng_state, set_rng_state
    state = rng_state()
    run.stash[SANITY_BATCHES] = n
    try:
        # through the hook, so what plugins wrap validation in holds here too (distrun-amp's
        # autocast, tp's loss_parallel); the core's implementation reads the limit
        run.hook.distrun_run_validation(run=run)
    finally:
        run.stash.pop(SANITY_BATCHES, None)
        set_rng_state(state)


def set_deterministic(run: Any) -> None:
    """``--deterministic``: torch's deterministic algorithms, said once with their cost."""
    if not run.config.deterministic:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it (CUDA >= 10.2)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    if run.is_global_zero:
        log.info("Deterministic algorithms on (--deterministic): cuDNN autotuning is off and "
                 "some CUDA ops (scatter/index_add, some convolutions and poolings) take slower "
                 "deterministic kernels, a cost that depends on the model (time a few steps "
                 "with and without); an op without a deterministic version raises. Most CPU "
                 "kernels are deterministic already.")
