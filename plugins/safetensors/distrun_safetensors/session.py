"""This run's checkpointer and folder, shared by the plugin's hooks and the checkpoint
callbacks (torch-free at import)."""

from __future__ import annotations

import os
from typing import Any

# run_key: the key of the run this process belongs to, recorded in every manifest it commits
# (its launcher's, the same on every node and through every restart of one launch; else
# torchrun's run id; else this process's own)
from distrun.plugin import StashKey, run_key
from distrun_safetensors.options import CheckpointOptions

__all__ = ["ckpt_dir", "run_key"]

#: the run's key when no launcher named one (``python train.py``): one per process, so the
#: fits of one script are one run

_KEY: StashKey[Any] = StashKey("safetensors")  # the Checkpointer


def _opts(run: Any) -> CheckpointOptions:
    return CheckpointOptions.of(run.config)


def _checkpointer(run: Any) -> Any:
    state = run.stash.get(_KEY)
    if state is None:
        from distrun_safetensors.save import Checkpointer

        cfg = _opts(run)
        state = Checkpointer(ckpt_dir(run), keep_last=cfg.ckpt_keep_last,
                             split_bytes=int(cfg.ckpt_split_mb * (1 << 20)),
                             async_save=cfg.ckpt_async,
                             rdzv_generation=run.generation)
        run.stash[_KEY] = state
    return state


def ckpt_dir(run: Any) -> str:
    return _opts(run).ckpt_dir or os.path.join(run.run_dir, "checkpoints")


