"""Seeding, and the RNG state the core contributes to checkpoints (so a resume replays it)."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["rng_state", "seed_everything", "set_rng_state"]


def seed_everything(seed: int) -> None:
    """Seed Python's, torch's (every device's) and, when installed, numpy's RNGs."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover
        pass


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": _to_json(random.getstate()), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [kind, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)]
    except ImportError:  # pragma: no cover
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    if "python" in state:
        random.setstate(_to_tuple(state["python"]))
    if "torch" in state:
        torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8))
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.as_tensor(state["cuda"], dtype=torch.uint8))


def _to_json(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_to_json(v) for v in value]
    return value


def _to_tuple(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_to_tuple(v) for v in value)
    return value
