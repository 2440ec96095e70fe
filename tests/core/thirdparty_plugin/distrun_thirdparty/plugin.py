"""Entry point: a strategy (``--strategy averaged``) and a logger (``--jsonl-every N``).

Torch-free at import; the strategy lives in :mod:`distrun_thirdparty.strategy`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from distrun.plugin import PluginOptions, StashKey, StrategyInfo, UsageError, hookimpl, option

DISTRUN_PLUGIN_API = 1

#: the open metrics file of a run, on rank 0
_FILE: StashKey = StashKey("thirdparty.jsonl")


@dataclass(frozen=True)
class ThirdPartyOptions(PluginOptions, plugin="thirdparty"):
    jsonl_every: int = option(0, "write metrics.jsonl every N steps (0: off)", min=0)


@hookimpl
def distrun_register_options(register):
    register(ThirdPartyOptions)


@hookimpl
def distrun_register_strategies(register):
    register(StrategyInfo("averaged", "distrun_thirdparty.strategy:Averaged",
                          help="replicated model, gradients averaged by all-reduce",
                          plugin="thirdparty", layout=_layout))


def _layout(config, world):
    if world > 8:
        raise UsageError(f"strategy 'averaged' runs on 8 ranks at most, not {world} "
                         "(use --strategy ddp)")
    return world


@hookimpl
def distrun_on_fit_start(run):
    if ThirdPartyOptions.of(run.config).jsonl_every and run.is_global_zero:
        run.stash[_FILE] = open(os.path.join(run.run_dir, "metrics.jsonl"), "w")  # noqa: SIM115


@hookimpl
def distrun_log_metrics(run, step, metrics):
    out = run.stash.get(_FILE)
    if out is not None and step % ThirdPartyOptions.of(run.config).jsonl_every == 0:
        out.write(json.dumps({"step": step, "world": run.world_size,
                              **{k: float(v) for k, v in metrics.items()}}) + "\n")


@hookimpl
def distrun_on_fit_end(run):
    out = run.stash.get(_FILE)
    if out is not None:
        out.close()
