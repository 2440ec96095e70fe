"""``ModelCheckpoint``: a checkpoint callback object (``Trainer(callbacks=[...])``). Torch-free.

Several may run at once; they share the run's checkpoint folder and checkpointer. Each keeps
the k best of its own measure: the monitored metric, or, without ``monitor``, the newest
steps. A step two callbacks both want is written once. Each callback removes only folders it
wrote itself, and only once no callback keeps them (the plugin hands the union of what all
keep, and what their writers let go, to the pruning after each commit; see
:func:`distrun_safetensors.retention.prune`). What each keeps is its checkpointed state, so a
resumed run goes on from it.
"""

from __future__ import annotations

import math
import os
from typing import Any

from distrun.plugin import UsageError, hookimpl
from distrun_safetensors.best import Entry, TopK
from distrun_safetensors.retention import CALLBACK_REASON
from distrun_safetensors.session import _checkpointer, ckpt_dir

__all__ = ["CALLBACK_REASON", "ModelCheckpoint", "owners"]
#: ``save_top_k=-1``: keep every checkpoint
_ALL = 1 << 62


class ModelCheckpoint:
    """Save checkpoints and keep the ``save_top_k`` best (Lightning's ``ModelCheckpoint``).

    When it saves: every ``every_n_steps`` optimizer steps, else every ``every_n_epochs``
    epochs (after the epoch's validation), else, with ``monitor``, each time a new value of
    ``monitor`` is logged (each validation for ``val_*``), else at the end of every epoch.
    What it keeps: with ``monitor``, the ``save_top_k`` best values (``mode`` ``min`` or
    ``max``); without, the ``save_top_k`` newest. ``save_top_k=-1`` keeps all, 0 saves
    nothing. The checkpoints go to the run's checkpoint folder (``--ckpt-dir``).
    """

    def __init__(self, monitor: str | None = None, mode: str = "min", save_top_k: int = 1,
                 every_n_steps: int = 0, every_n_epochs: int = 0) -> None:
        if mode not in ("min", "max"):
            raise UsageError(f"ModelCheckpoint(mode={mode!r}): mode is 'min' or 'max'")
        if save_top_k < -1 or every_n_steps < 0 or every_n_epochs < 0:
            raise UsageError("ModelCheckpoint: save_top_k is -1 (all), 0 (none) or more; "
                             "every_n_steps and every_n_epochs are 0 (off) or more")
        self.monitor, self.mode, self.save_top_k = monitor or None, mode, save_top_k
        self.every_n_steps, self.every_n_epochs = every_n_steps, every_n_epochs
        k = _ALL if save_top_k == -1 else max(save_top_k, 1)
        self.top = TopK(self.monitor or "step", mode if self.monitor else "max", k)
        #: the folders this callback wrote (it may remove only these)
        self.created: set[str] = set()
        self.dir: str | None = None
        self._warned = False

    @property
    def state_key(self) -> str:
        return (f"model_checkpoint[monitor={self.monitor},mode={self.mode},"
                f"top_k={self.save_top_k},every_n_steps={self.every_n_steps},"
                f"every_n_epochs={self.every_n_epochs}]")

    @property
    def best_model_path(self) -> str:
        """The folder of the best checkpoint kept so far ("" before the first)."""
        first = self.top.first
        return os.path.join(self.dir, first) if first and self.dir else ""

    @property
    def best_k_models(self) -> dict[str, float]:
        """folder path -> value, best first (the step number when nothing is monitored)."""
        return {os.path.join(self.dir or "", e.folder): e.value for e in self.top.entries}

    def kept(self) -> frozenset[str]:
        return self.top.names

    def __repr__(self) -> str:
        return f"ModelCheckpoint({self.state_key.split('[', 1)[1][:-1]})"

    # -- when to save -----------------------------------------------------------------------
    def maybe_save(self, run: Any, value: float | None) -> str | None:
        """Save the current step when ``value`` is among the k best (every rank together)."""
        if self.save_top_k == 0 or getattr(run, "stage", "fit") != "fit" or run.model is None \
                or run.config.fast_dev_run:
            return None
        step = run.progress.step
        if value is None:
            value = float(step)
        if not math.isfinite(value):
            return None
        folder = f"step-{step}"
        if not self.top.qualifies(value, folder):
            return None
        saver = _checkpointer(run)
        saver.wait()
        written = saver.last is not None and saver.last[0] == step and os.path.isdir(saver.last[1])
        self.top.add(Entry(value, step, folder))
        if not written:
            self.created.add(folder)
        return run.save_checkpoint(CALLBACK_REASON)

    def _value(self, run: Any) -> float | None:
        """The monitored value now, or None (said once when it was never logged)."""
        if self.monitor is None:
            return float(run.progress.step)
        if self.monitor in run.metrics:
            return float(run.metrics[self.monitor])
        if not self._warned and run.is_global_zero:
            run.log.warning("warning: %r: no metric %s was logged by step %d, so it saves "
                            "nothing yet (logged: %s)", self, self.monitor, run.progress.step,
                            ", ".join(sorted(run.metrics)) or "none")
        self._warned = True
        return None

    # -- hooks ------------------------------------------------------------------------------
    @hookimpl
    def distrun_on_fit_start(self, run: Any) -> None:
        self.dir = ckpt_dir(run)
        if self.every_n_steps:
            run.add_hooks(_EverySteps(self))
        elif self.every_n_epochs or not self.monitor:
            run.add_hooks(_EveryEpochs(self))
        else:
            run.add_hooks(_OnLogged(self))

    @hookimpl
    def distrun_state_dict(self, run: Any) -> dict[str, Any]:
        return {self.state_key: {
            "top": [[e.value, e.step, e.folder] for e in self.top.entries],
            "created": sorted(self.created)}}

    @hookimpl
    def distrun_load_state_dict(self, run: Any, state: Any) -> None:
        mine = state.get(self.state_key)
        if mine is None:
            return
        self.top = TopK(self.top.name, self.top.mode, self.top.k,
                        [Entry(float(v), int(s), str(f)) for v, s, f in mine["top"]])
        self.created = set(mine["created"])


class _EverySteps:
    def __init__(self, owner: ModelCheckpoint) -> None:
        self.owner = owner

    @hookimpl(trylast=True)  # after the callbacks whose state it saves
    def distrun_on_step_end(self, run: Any, step: int) -> None:
        if step % self.owner.every_n_steps == 0:
            value = self.owner._value(run)
            if value is not None:
                self.owner.maybe_save(run, value)


class _EveryEpochs:
    def __init__(self, owner: ModelCheckpoint) -> None:
        self.owner = owner

    @hookimpl(trylast=True)  # after the callbacks whose state it saves
    def distrun_on_epoch_end(self, run: Any, epoch: int) -> None:
        if (epoch + 1) % max(self.owner.every_n_epochs, 1) == 0:
            value = self.owner._value(run)
            if value is not None:
                self.owner.maybe_save(run, value)


class _OnLogged:
    def __init__(self, owner: ModelCheckpoint) -> None:
        self.owner = owner

    @hookimpl(trylast=True)  # after the callbacks whose state it saves
    def distrun_log_metrics(self, run: Any, step: int, metrics: Any) -> None:
        name = self.owner.monitor
        if name in metrics:
            self.owner.maybe_save(run, float(metrics[name]))


def owners(run: Any, saver: Any, reason: str) -> tuple[frozenset[str], frozenset[str]] | None:
    """(folders some checkpoint callback keeps, folders their writers let go and none keeps),
    for the pruning after the save of ``run.progress.step`` starting now.

    A save that is not a callback's and writes a new folder (not one this run committed at
    this step) replaces any of that name on disk: no callback wrote what it will hold."""
    callbacks = [p for p in run.pm.get_plugins() if isinstance(p, ModelCheckpoint)]
    if not callbacks:
        return None
    saver.wait()  # (save() would: the previous async write's commit sets saver.last)
    step = run.progress.step
    if reason != CALLBACK_REASON and not (saver.last is not None and saver.last[0] == step):
        for c in callbacks:
            c.created.discard(f"step-{step}")
    held = frozenset().union(*(c.kept() for c in callbacks))
    released = frozenset().union(*(c.created for c in callbacks)) - held
    return held, released
