"""The catalogue of first-party plugins (``catalogue.toml``, data): which distribution offers a
strategy, a backend or a flag, so a name that is not installed gets its ``pip install`` hint.

The core knows no plugin: each entry is what that plugin's own pyproject.toml declares under
``[tool.distrun.offers]`` (tests/core/test_catalogue.py keeps them equal). Torch-free.
"""

from __future__ import annotations

import functools
from importlib import resources

import tomllib

__all__ = ["offered"]


@functools.cache
def _entries() -> dict[str, dict[str, list[str]]]:
    text = (resources.files("distrun._registry") / "catalogue.toml").read_text()
    return tomllib.loads(text)


@functools.cache
def offered(kind: str) -> dict[str, str]:
    """``name -> distribution`` for ``kind`` ``"strategies"``, ``"backends"`` or ``"flags"``."""
    return {name: dist for dist, offers in _entries().items() for name in offers.get(kind, ())}
