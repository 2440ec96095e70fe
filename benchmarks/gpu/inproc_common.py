"""What the GPU lane's in-process checks (step_check.py, amp_check.py, ckpt_check.py)
share: the result file they rewrite after every measurement (lane_procs.Result), and the
device they run on.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

from lane_procs import Result  # the same result file as the lane's own checks

__all__ = ["Result"]


def _device(dry: bool) -> Any:
    import torch

    if dry or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", 0)


def _sync(dev: Any) -> Callable[[], None]:
    import torch

    if dev.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def _free() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
