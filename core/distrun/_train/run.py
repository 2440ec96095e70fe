"""The state of one worker's run, handed to every loop hook as ``run``."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from distrun._launch.generation import read_generation
from distrun._spec.errors import EXIT_REQUEUE
from distrun._spec.stash import Stash

if TYPE_CHECKING:
    import pluggy
    import torch

    from distrun._config.run_config import RunConfig
    from distrun._spec.strategy import Strategy
    from distrun._train.sampler import ResumableSampler
    from distrun._train.schedulers import Scheduled

__all__ = ["EXIT_REQUEUE", "Progress", "Run"]


log = logging.getLogger("distrun")


@dataclass
class Progress:
    """Where the loop is. ``step`` counts optimizer steps over the whole run."""

    epoch: int = 0
    step: int = 0
    micro_step: int = 0
    samples: int = 0
    #: ``time.monotonic()`` at the last step boundary (not saved): how long a failure waited
    step_started: float = field(default_factory=time.monotonic, compare=False)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "step": self.step, "micro_step": self.micro_step,
                "samples": self.samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("epoch", "step", "micro_step", "samples"):
            setattr(self, key, int(state.get(key, 0)))


class Run:
    """One worker's view of the run: config, task, strategy, model, data and progress.

    Plugins may replace ``model``, ``optimizer``, ``lr_scheduler``, ``train_loader`` and
    ``val_loader`` in the setup hooks, and keep their own objects in ``run.stash`` under a
    :class:`~distrun._spec.stash.StashKey` they define.
    """

    def __init__(self, config: RunConfig, task: Any, pm: pluggy.PluginManager) -> None:
        self.config = config
        self.task = task
        #: what runs: "fit", "validate", "test" or "predict"
        self.stage = "fit"
        self.pm = pm
        self.hook = pm.hook
        self.strategy: Strategy = None  # type: ignore[assignment]
        # set during setup (strategy first), before any loop hook sees the run
        self.model: torch.nn.Module = None  # type: ignore[assignment]
        self.optimizer: torch.optim.Optimizer = None  # type: ignore[assignment]
        self.lr_scheduler: Any = None
        #: every scheduler and when it steps (from ``lr_scheduler`` at the end of setup)
        self.schedulers: list[Scheduled] = []
        self.train_loader: Any = None
        self.val_loader: Any = None
        self.sampler: ResumableSampler | None = None
        self.progress = Progress()
        self.metrics: dict[str, float] = {}
        #: what each finished stage gave: fit its last metrics, validate/test their metrics,
        #: predict its outputs
        self.results: dict[str, Any] = {}
        self.stash = Stash()
        #: a stop signal this rank received (the loop agrees on it with the others)
        self.stop_signal: int | None = None
        self.stop_requested = False
        #: set by the loop: stop after this step (agreed by every rank, or max_steps)
        self.done = False
        self.resumed_from: str | None = None
        #: the rendezvous round this worker belongs to: it grows with every round of an
        #: elastic run and is the same on every rank of a round; 0 outside the elastic agent
        #: (``DISTRUN_RDZV_GENERATION``, read once here). A checkpoint commit records it.
        self.generation: int = read_generation()
        self.run_dir = config.run_dir
        self.log = log
        self._scoped: list[Any] = []

    # -- topology, from the strategy once it is set up (torchrun's env before that) --------
    @property
    def rank(self) -> int:
        if self.strategy is not None:
            return self.strategy.rank
        return int(os.environ.get("RANK", "0"))

    @property
    def world_size(self) -> int:
        if self.strategy is not None:
            return self.strategy.world_size
        return int(os.environ.get("WORLD_SIZE", "1"))

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def is_global_zero(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        return self.strategy.device

    def unwrapped_model(self) -> torch.nn.Module:
        """The user's module without DDP/DP wrappers (FSDP/TP modules stay sharded)."""
        return self.strategy.unwrap_model(self.model)

    def add_hooks(self, plugin: Any) -> None:
        """Register ``plugin``'s hook implementations for this fit only; unregistered at
        teardown. A plugin puts its per-step hooks there when it is active in this run, so a
        plugin that is installed but not used costs the loop nothing."""
        self.pm.register(plugin)
        self._scoped.append(plugin)

    def remove_scoped_hooks(self) -> None:
        """Unregister what :meth:`add_hooks` registered (the trainer calls this at teardown)."""
        while self._scoped:
            plugin = self._scoped.pop()
            if self.pm.is_registered(plugin):
                self.pm.unregister(plugin)

    def request_stop(self) -> None:
        """Ask the run to end soon, as if it had finished (early stopping).

        Any rank may ask: the ranks agree at a step boundary (they vote about every 0.1 s of
        training) and stop after the same step.
        """
        self.stop_requested = True

    def save_checkpoint(self, reason: str = "user") -> str | None:
        """Write a checkpoint now (every rank must call this together); returns its path."""
        path = self.hook.distrun_save_checkpoint(run=self, reason=reason)
        if path is None and reason == "user":
            log.warning("no checkpoint plugin is installed: pip install distrun-safetensors")
        return path

    def state_dict(self) -> dict[str, Any]:
        """Every contributed state of this rank (``progress``, ``sampler``, ``rng``, plugins')."""
        merged: dict[str, Any] = {}
        for part in self.hook.distrun_state_dict(run=self):
            if not part:
                continue
            for name, value in part.items():
                if name in merged:
                    raise RuntimeError(f"two plugins contribute checkpoint state named {name!r}")
                merged[name] = value
        return merged

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.hook.distrun_load_state_dict(run=self, state=state)
