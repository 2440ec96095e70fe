"""The task's hyperparameters (``Task.save_hyperparameters``) in the run folder."""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["HPARAMS_FILE", "write_hparams"]

HPARAMS_FILE = "hparams.json"


def write_hparams(run_dir: str, hparams: dict[str, Any]) -> str:
    """Write ``RUN_DIR/hparams.json`` atomically (rank 0); its path."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, HPARAMS_FILE)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        json.dump(hparams, fh, indent=2, sort_keys=True)
        fh.write("\n")
    os.replace(tmp, path)
    return path
