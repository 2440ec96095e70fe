"""The ``averaged`` strategy: gradients averaged with one all-reduce per parameter."""

from __future__ import annotations

import torch.distributed as dist

from distrun.plugin import BaseStrategy


class Averaged(BaseStrategy):
    """The model replicated on every rank; after backward each gradient is averaged."""

    name = "averaged"

    def optimizer_step(self, optimizer):
        if self.world_size > 1:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                        p.grad /= self.world_size
        optimizer.step()
