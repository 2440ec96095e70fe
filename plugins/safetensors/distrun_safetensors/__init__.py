"""distrun-safetensors: sharded, crash-consistent safetensors checkpoints for distrun.

Importing the package does not import torch (the ``distrun`` command loads it as a plugin).
"""

from __future__ import annotations

from typing import Any

from distrun_safetensors.files import CheckpointError

__all__ = ["CheckpointError", "Checkpointer", "ModelCheckpoint", "load_checkpoint",
           "load_weights", "validate"]

_LAZY = {"Checkpointer": ("distrun_safetensors.save", "Checkpointer"),
         "ModelCheckpoint": ("distrun_safetensors.callback", "ModelCheckpoint"),
         "load_checkpoint": ("distrun_safetensors.load", "load"),
         "load_weights": ("distrun_safetensors.weights", "load_weights"),
         "validate": ("distrun_safetensors.validation", "validate")}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'distrun_safetensors' has no attribute {name!r}")
