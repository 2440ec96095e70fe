"""Open the run's ``SummaryWriter`` (imports torch and tensorboard)."""

from __future__ import annotations

import os
from typing import Any

from distrun_tensorboard.options import TensorBoardOptions

__all__ = ["event_dir", "open_writer"]


def event_dir(run: Any) -> str:
    """``--tensorboard-dir``, else ``RUN_DIR/tensorboard``."""
    return TensorBoardOptions.of(run.config).tensorboard_dir or os.path.join(run.run_dir or ".", "tensorboard")


def open_writer(run: Any) -> Any:
    """A writer for this run; on resume, events after the restored step are purged."""
    from torch.utils.tensorboard import SummaryWriter

    purge = run.progress.step + 1 if run.resumed_from else None
    writer = SummaryWriter(log_dir=event_dir(run), purge_step=purge,
                           flush_secs=int(TensorBoardOptions.of(run.config).tensorboard_flush_secs) or 1)
    if run.resumed_from is None:
        writer.add_text("config", "```toml\n" + run.config.to_toml() + "```", global_step=0)
    return writer
