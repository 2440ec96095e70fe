"""A test-only strategy: replicated model, gradients averaged with a plain all-reduce.

It proves the core loop, sampler and metric reduction on real gloo ranks without any plugin.
"""

from __future__ import annotations

from distrun.plugin import StrategyInfo, hookimpl


def _factory(config):
    import torch.distributed as dist

    from distrun.plugin import BaseStrategy

    class AllReduce(BaseStrategy):
        name = "allreduce"

        def backward(self, loss):
            loss.backward()

        def optimizer_step(self, optimizer):
            if self.distributed:
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            dist.all_reduce(p.grad)
                            p.grad /= self.world_size
            optimizer.step()

    return AllReduce(config)


@hookimpl
def distrun_register_strategies(register):
    register(StrategyInfo("allreduce", _factory, help="test: replicated + grad all-reduce",
                          plugin="tests"))
