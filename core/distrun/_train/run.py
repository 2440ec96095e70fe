"""The state of one worker's run, handed to every loop hook as ``run``."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from distrun._diagnose.position import LOOP_PHASES, Phase, marks
from distrun._diagnose.straggler import ComputeTimes
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

__all__ = ["EXIT_REQUEUE", "RUN_ATTRIBUTE", "LoopState", "Progress", "Run", "RunContext", "run_of"]

#: where a run leaves a weak reference to itself on its task (:func:`run_of`; weak: the task
#: does not keep its run alive)
RUN_ATTRIBUTE = "_distrun_run"


def run_of(task: Any) -> Run | None:
    """The run training ``task`` (``Task.trainer``, ``self.optimizers()``), None outside one."""
    ref = getattr(task, RUN_ATTRIBUTE, None)
    return ref() if ref is not None else None


log = logging.getLogger("distrun")


@dataclass
class Progress:
    """Where the loop is. ``step`` counts optimizer steps over the whole run."""

    epoch: int = 0
    step: int = 0
    micro_step: int = 0
    samples: int = 0
    #: the index of the micro-batch in this epoch the loop is at (Lightning's ``batch_idx``)
    batch_idx: int = 0
    #: ``time.monotonic()`` at the last step boundary (not saved): how long a failure waited
    step_started: float = field(default_factory=time.monotonic, compare=False)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "step": self.step, "micro_step": self.micro_step,
                "samples": self.samples, "batch_idx": self.batch_idx}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("epoch", "step", "micro_step", "samples", "batch_idx"):
            setattr(self, key, int(state.get(key, 0)))


@dataclass(frozen=True)
class RunContext:
    """What is fixed for a run's session: read by every hook, never reassigned."""

    config: RunConfig
    task: Any
    pm: pluggy.PluginManager
    #: the rendezvous round this worker belongs to: it grows with every round of an elastic
    #: run and is the same on every rank of a round; 0 outside the elastic agent
    #: (``DISTRUN_RDZV_GENERATION``, read once). A checkpoint commit records it.
    generation: int = 0
    log: logging.Logger = log

    @property
    def run_dir(self) -> str:
        return self.config.run_dir


@dataclass
class LoopState:
    """What the loop changes as it runs: where it is, the last metrics, whether it stops."""

    progress: Progress = field(default_factory=Progress)
    metrics: dict[str, float] = field(default_factory=dict)
    #: a stop signal this rank received (the loop agrees on it with the others)
    stop_signal: int | None = None
    stop_requested: bool = False
    #: set by the loop: stop after this step (agreed by every rank, or max_steps)
    done: bool = False
    #: inside :meth:`Run.stop_signals_held`: the stop signals that came meanwhile, in order
    held_signals: list[int] | None = None


class Run:
    """One worker's view of the run: config, task, strategy, model, data and progress.

    Three kinds of state, kept apart:

    - fixed for the session (:attr:`fixed`, a frozen :class:`RunContext`): ``config``,
      ``task``, ``pm``, ``hook``, ``generation``, ``run_dir``, ``log``; read-only here;
    - built by the setup hooks: ``strategy``, ``model``, ``optimizer``, ``lr_scheduler``,
      ``schedulers``, ``train_loader``, ``val_loader``, ``sampler``. Plugins may replace
      ``model``, ``optimizer``, ``lr_scheduler``, ``train_loader`` and ``val_loader`` in the
      setup hooks, and keep their own objects in ``run.stash`` under a
      :class:`~distrun._spec.stash.StashKey` they define;
    - changed by the loop (:attr:`state`, a :class:`LoopState`): ``progress``, ``metrics``,
      ``done``, ``stop_requested``, ``stop_signal``.
    """

    def __init__(self, config: RunConfig, task: Any, pm: pluggy.PluginManager) -> None:
        self.fixed = RunContext(config, task, pm, generation=read_generation())
        self.state = LoopState()
        self._hook = pm.hook
        #: what runs: "fit", "validate", "test" or "predict"
        self.stage = "fit"
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
        #: what each finished stage gave: fit its last metrics, validate/test their metrics,
        #: predict its outputs
        self.results: dict[str, Any] = {}
        self.stash = Stash()
        self.resumed_from: str | None = None
        #: the DataModule the stages read data from before the task (``fit(task, datamodule=)``)
        self.datamodule: Any = None
        self._scoped: list[Any] = []
        try:  # the task's ``self.trainer`` (run_of)
            setattr(task, RUN_ATTRIBUTE, weakref.ref(self))
        except (AttributeError, TypeError):  # a task that takes no attributes
            pass

    # -- fixed for the session ------------------------------------------------------------
    @property
    def config(self) -> RunConfig:
        return self.fixed.config

    @property
    def task(self) -> Any:
        return self.fixed.task

    @property
    def pm(self) -> pluggy.PluginManager:
        return self.fixed.pm

    @property
    def hook(self) -> Any:
        """``pm.hook``: ``run.hook.distrun_<name>(run=run, ...)``."""
        return self._hook

    @property
    def generation(self) -> int:
        return self.fixed.generation

    @property
    def run_dir(self) -> str:
        return self.fixed.config.run_dir

    @property
    def log(self) -> logging.Logger:
        return self.fixed.log

    # -- changed by the loop ----------------------------------------------------------------
    @property
    def progress(self) -> Progress:
        return self.state.progress

    @property
    def metrics(self) -> dict[str, float]:
        return self.state.metrics

    @property
    def done(self) -> bool:
        return self.state.done

    @done.setter
    def done(self, value: bool) -> None:
        self.state.done = value

    @property
    def stop_requested(self) -> bool:
        return self.state.stop_requested

    @stop_requested.setter
    def stop_requested(self, value: bool) -> None:
        self.state.stop_requested = value

    @property
    def stop_signal(self) -> int | None:
        return self.state.stop_signal

    @stop_signal.setter
    def stop_signal(self, value: int | None) -> None:
        self.state.stop_signal = value

    # -- Lightning's names for the same things (a ported callback reads these) ---------------
    @property
    def current_epoch(self) -> int:
        return self.state.progress.epoch

    @property
    def global_step(self) -> int:
        return self.state.progress.step

    @property
    def callback_metrics(self) -> dict[str, float]:
        return self.state.metrics

    @property
    def should_stop(self) -> bool:
        return self.state.stop_requested or self.state.done

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        if value:
            self.request_stop()

    @property
    def global_rank(self) -> int:
        return self.rank

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
        """The user's module without DDP/DP wrappers (FSDP/TP modules stay sharded); for a
        ``distrun.Models``, a container of each model unwrapped."""
        from distrun._train.models import unwrap

        return unwrap(self.strategy, self.model)

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

    @contextlib.contextmanager
    def stop_signals_held(self) -> Iterator[None]:
        """Hold the stop signals (SIGTERM, SIGINT, SIGUSR1) that come during this block and
        handle them at its end, as if they came then: for work that must not be cut in two.
        A launcher stops a rank whose peer died with SIGTERM, which raises in the loop's
        thread wherever it is (the step cannot finish without the peer); the rows of a
        checkpoint's steps, logged just after its commit, would be lost from the cut on."""
        if self.state.held_signals is not None:  # nested: the outermost block handles them
            yield
            return
        self.state.held_signals = []
        try:
            yield
        finally:
            came, self.state.held_signals = self.state.held_signals, None
            for signum in came:
                signal.raise_signal(signum)  # the handler runs now, in this thread

    def request_stop(self) -> None:
        """Ask the run to end soon, as if it had finished (early stopping).

        Any rank may ask: the ranks agree at a step boundary (they vote about every 0.1 s of
        training) and stop after the same step.
        """
        self.stop_requested = True

    def mark(self, phase: str, step: int | None = None) -> None:
        """Where this rank is, from a plugin that runs its own loop (distrun-ft's): what the
        stall watcher and ``distrun stacks`` show, as distrun's loop marks it. ``phase``:
        ``data``, ``forward`` (the task's training_step), ``backward``, ``optimizer``,
        ``boundary`` (between steps), ``validation``, ``checkpoint`` or ``quorum`` (waiting
        for other replica groups: their stall, never this group's). ``step``: optimizer step
        ``step`` is done (the watcher sees the run move; ``phase`` is then ignored). Costs a
        write to shared memory; nothing where the launcher keeps no records."""
        rec = marks()
        if step is not None:
            rec.step_done(step)
            return
        try:
            rec.phase(LOOP_PHASES[phase])
        except KeyError:
            raise ValueError(f"run.mark({phase!r}): the phase is one of "
                             f"{', '.join(LOOP_PHASES)}") from None

    def compute_times(self, world: int | None = None, index: int | None = None,
                      name: Callable[[int], str] | None = None) -> ComputeTimes:
        """The slow-rank check for a plugin that runs its own loop (distrun-ft's), as distrun's
        loop does it at its step boundary: this rank's compute time per step (data, forward,
        optimizer, as :meth:`mark` marks them; backward holds the waits for the others) added
        to a SUM reduction the loop runs anyway, every rank's judged from the sum.
        ``world``, ``index``: who takes part in that reduction and this rank's place (the
        run's world and rank); ``name``: what a line calls the n-th (by default ``rank 3
        (host h1)``, or its node where the ranks span several).
        ``pack(step)`` gives this rank's ``size`` floats at the end of step ``step`` (zeros in
        the others' places); ``add(summed)`` returns a line naming a straggler once (log it
        from one rank), and ``spread`` the last window's slowest and fastest (metrics)."""
        return ComputeTimes(self.world_size if world is None else world,
                            self.rank if index is None else index, self.progress.step,
                            socket.gethostname(), int(os.environ.get("GROUP_RANK", "0") or 0),
                            name)

    def save_checkpoint(self, reason: str = "user") -> str | None:
        """Write a checkpoint now (every rank must call this together); returns its path."""
        rec = marks()
        was = rec.current
        rec.phase(Phase.CHECKPOINT)
        try:
            path = self.hook.distrun_save_checkpoint(run=self, reason=reason)
        finally:
            rec.phase(was)
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

    def scheduler_states(self) -> list[Any]:
        """The ``state_dict`` of each of the run's LR schedulers that has one, in order (for a
        plugin that keeps the optimizer's state its own way, as Join's uneven-input wrapper)."""
        from distrun._train.schedulers import scheduler_states

        return scheduler_states(self.schedulers)

    def load_scheduler_states(self, states: list[Any]) -> None:
        """Give each stateful scheduler back its state from :meth:`scheduler_states`."""
        from distrun._train.schedulers import load_scheduler_states

        load_scheduler_states(self.schedulers, states)
