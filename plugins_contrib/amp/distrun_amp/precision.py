"""Autocast and gradient scaling for one run (imports torch)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch

from distrun.plugin import UsageError

__all__ = ["MixedPrecision"]

_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class MixedPrecision:
    """The autocast settings of ``precision`` on ``device`` and, for float16, a GradScaler."""

    def __init__(self, precision: str, device: torch.device) -> None:
        self.precision = precision
        self.device_type = device.type
        self.dtype = _DTYPES[precision]
        self.scaler: Any = None
        if precision == "16-mixed":
            if device.type != "cuda":
                raise UsageError(
                    f"--precision 16-mixed needs a CUDA device (this run is on {device.type}); "
                    "use --precision bf16-mixed on CPU"
                )
            self.scaler = torch.amp.GradScaler("cuda")
        elif device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise UsageError(
                "--precision bf16-mixed: this GPU has no bfloat16 support (use 16-mixed)"
            )

    def autocast(self) -> AbstractContextManager[Any]:
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def loss_to_float(self, loss: Any) -> Any:
        """The loss in float32, so the loop's running sums do not lose precision."""
        if isinstance(loss, torch.Tensor) and loss.dtype in (torch.bfloat16, torch.float16):
            return loss.float()
        return loss

    def scaled_step(self, run: Any) -> None:
        """Unscale, clip (``grad_clip``), step unless gradients overflowed, update the scale."""
        self.scaler.unscale_(run.optimizer)
        if run.config.grad_clip > 0:
            run.strategy.clip_grad_norm(run.model, run.config.grad_clip)
        self.scaler.step(run.optimizer)
        self.scaler.update()
