"""``"module:attr"`` strings: how a plugin names a function or class without importing it."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["import_target"]


def import_target(target: str) -> Any:
    """The object a ``"module:attr"`` (or ``"module:Class.attr"``) string names, imported now."""
    module, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj
