"""``DataParallelStrategy``: torch.nn.DataParallel in one process over the visible GPUs.

Without GPUs DataParallel does nothing at all (it calls the module directly), so the strategy
says so once and trains exactly as ``single``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from distrun.plugin import BaseStrategy, UsageError

if TYPE_CHECKING:
    from distrun.plugin import Run

__all__ = ["DataParallelStrategy", "CPU_WARNING"]

log = logging.getLogger("distrun")

CPU_WARNING = ("strategy 'dp': no CUDA device is visible, and DataParallel does nothing on CPU; "
               "training as 'single' (use --strategy ddp with --nproc-per-node N for CPU "
               "data parallelism)")


class DataParallelStrategy(BaseStrategy):
    """One process; the batch is scattered over the GPUs each forward, gradients summed back."""

    name = "dp"

    def setup(self, run: Run) -> None:
        if self.world_size > 1:
            raise UsageError(
                f"strategy 'dp' runs in one process but this run has {self.world_size} "
                "(use --nproc-per-node 1, or --strategy ddp)")
        super().setup(run)
        self.gpus = torch.cuda.device_count() if self.device.type == "cuda" else 0
        if self.gpus == 0:
            log.warning(CPU_WARNING)
        else:
            # DataParallel gathers outputs on the first device: it is the run's device.
            self.device = torch.device("cuda", 0)
            torch.cuda.set_device(self.device)

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        model = model.to(self.device)
        if self.gpus == 0:
            return model
        return torch.nn.DataParallel(model, device_ids=list(range(self.gpus)),
                                     output_device=self.device)

    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.module if isinstance(model, torch.nn.DataParallel) else model
