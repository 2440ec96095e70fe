"""The core's implementations of the setup hooks: the model wrapped (activation
checkpointing, the strategy, ``--compile``), the optimizer built, the loaders built."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from distrun._spec.errors import UsageError
from distrun._spec.stash import StashKey
from distrun._train import models
from distrun._train.datamodule import data_of, prepare
from distrun._train.iterable import StreamCursor, stream_loader
from distrun._train.limits import overfit_val_data, train_limit
from distrun._train.loaders import map_loader
from distrun._train.optimizers import build_optimizers, check_manual, wrap_optimizers
from distrun._train.run import Run
from distrun._train.sampler import ResumableSampler, is_map_dataset
from distrun._train.stages import eval_loader

__all__ = ["STREAM", "build_loaders", "build_optimizer", "wrap_model"]

log = logging.getLogger("distrun")


#: the cursor of a stateful training loader (an IterableDataset's, or the task's own
#: StatefulDataLoader): where a checkpoint resumes the stream
STREAM: StashKey[StreamCursor] = StashKey("loop.stream")


def _is_optimizer(value: Any) -> bool:
    """A torch optimizer, or one shaped like it (``step`` and ``zero_grad``)."""
    return isinstance(value, torch.optim.Optimizer) or (
        callable(getattr(value, "step", None)) and callable(getattr(value, "zero_grad", None)))


def _describe(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, dict):
        return f"a dict (keys {', '.join(map(repr, list(value)[:5]))})"
    return f"a {type(value).__name__} ({str(value)[:40]!r})"


def wrap_model(run: Run) -> None:
    if run.config.activation_checkpointing:
        from distrun._train.activation_ckpt import apply_activation_checkpointing

        count = apply_activation_checkpointing(run.model, run.config.activation_checkpointing)
        if run.is_global_zero:
            log.info("Activation checkpointing: %d modules recompute their activations in "
                     "the backward pass", count)
    run.model = models.wrap_model(run.strategy, run.model)  # each of a distrun.Models
    if run.config.compile:
        # In place (nn.Module.compile): the module and its state_dict keys stay as they were
        # (no `_orig_mod.`), and it compiles what the strategy made: DDP's module with its
        # bucketed all-reduces (DDPOptimizer), FSDP2/TP modules with their collectives, a
        # pipeline's stage modules. The clock times it (said once, left out of samples/s).
        from distrun._train.compiling import start_clock

        start_clock(run)
        models.compile_model(run.strategy, run.model)


def build_optimizer(run: Run) -> None:
    if run.optimizer is None and callable(getattr(run.task, "configure_optimizers", None)):
        build_optimizers(run)  # Lightning's: several optimizers (and schedulers)
    if run.optimizer is None:
        made = run.task.configure_optimizer(run.model.parameters())
        if isinstance(made, Mapping):  # Lightning's {"optimizer": o, "lr_scheduler": s}
            if "optimizer" not in made:
                raise UsageError("configure_optimizer returned a dict without 'optimizer'; "
                                 "return an optimizer or {'optimizer': o, 'lr_scheduler': s}")
            run.optimizer = made["optimizer"]
            if made.get("lr_scheduler") is not None and run.lr_scheduler is None:
                run.lr_scheduler = made["lr_scheduler"]
        else:
            run.optimizer = made
        if not _is_optimizer(run.optimizer):
            raise UsageError(
                f"{type(run.task).__name__}.configure_optimizer(params) returned "
                f"{_describe(run.optimizer)}; it must return a torch.optim.Optimizer (e.g. "
                "`return torch.optim.AdamW(params, lr=1e-3)`) or {'optimizer': o, "
                "'lr_scheduler': s}")
        sched = getattr(run.task, "configure_scheduler", None)
        if sched is not None and run.lr_scheduler is None:
            run.lr_scheduler = sched(run.optimizer)
    run.optimizer = wrap_optimizers(run.strategy, run.optimizer)
    check_manual(run)


def build_loaders(run: Run) -> None:
    cfg, st = run.config, run.strategy
    prepare(run)
    collate = data_of(run, "collate_fn")
    # A generator of its own: iter(DataLoader) otherwise draws a seed from the global RNG,
    # so a resume mid-epoch would shift the RNG stream (dropout) against the uninterrupted run.
    common: dict[str, Any] = dict(num_workers=cfg.num_workers, collate_fn=collate,
                  pin_memory=st.device.type == "cuda",
                  persistent_workers=cfg.num_workers > 0,
                  generator=torch.Generator().manual_seed(cfg.seed))
    if "fit" not in cfg.stage.split(","):
        data = None  # an evaluation session: no training data to read
    else:
        data = data_of(run, "train_data")
    if data is None:
        pass
    elif isinstance(data, torch.utils.data.IterableDataset):
        run.train_loader = stream_loader(data, cfg.batch_size, st.dp_rank, st.dp_world_size,
                                         **common)
    elif is_map_dataset(data):
        run.sampler = ResumableSampler(len(data), cfg.batch_size, st.dp_rank, st.dp_world_size,
                                       seed=cfg.seed, shuffle=not cfg.overfit_batches,
                                       limit=train_limit(cfg), drop_last=cfg.drop_last)
        run.train_loader = map_loader(data, run.sampler, **common)
    else:
        run.train_loader = data
    if hasattr(run.train_loader, "state_dict") and hasattr(run.train_loader, "load_state_dict"):
        run.stash[STREAM] = StreamCursor(run.train_loader)  # a stateful loader: resumable
    if cfg.overfit_batches and data is not None and is_map_dataset(data):
        run.val_loader = eval_loader(run, overfit_val_data(run, data))
        return
    run.val_loader = eval_loader(run, data_of(run, "val_data"))
