"""The ``single`` strategy: one process, one device. Core's only strategy."""

from __future__ import annotations

from typing import TYPE_CHECKING

from distrun._spec.errors import UsageError
from distrun._spec.markers import hookimpl
from distrun._spec.strategy import StrategyInfo

if TYPE_CHECKING:
    from distrun._config.run_config import RunConfig


def _make_single(config: RunConfig):
    from distrun._strategies.base import BaseStrategy

    class SingleStrategy(BaseStrategy):
        name = "single"

        def setup(self, run):
            if self.world_size > 1:
                raise UsageError(
                    f"strategy 'single' trains in one process but this run has "
                    f"{self.world_size} (use --strategy ddp, or --nproc-per-node 1)"
                )
            super().setup(run)

    return SingleStrategy(config)


@hookimpl
def distrun_register_strategies(register):
    register(StrategyInfo("single", _make_single, help="one process, one device",
                          multi_process=False, layout=lambda config, world: 1))
