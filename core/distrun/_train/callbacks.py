"""Callback objects (``Trainer(callbacks=[...])``): each one becomes a pluggy plugin.

An object that already carries ``@hookimpl`` methods (``distrun_on_step_end`` ...) is
registered as it is. Any other object is read for Lightning's method names
(``on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)``, ``state_dict()`` ...)
and gets an adapter: a plugin whose hook implementations call those methods, built with only
the hooks the object answers, so a callback without per-step methods costs the loop nothing.
``trainer`` is the :class:`~distrun._train.run.Run` (it has Lightning's ``current_epoch``,
``global_step``, ``callback_metrics``, ``should_stop``, ``is_global_zero``) and ``pl_module``
the task.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from distrun._spec.errors import UsageError
from distrun._spec.markers import PROJECT, hookimpl

__all__ = ["Callback", "LIGHTNING_METHODS", "as_plugins"]

log = logging.getLogger("distrun")


class Callback:
    """A base class for callback objects (optional: any object with these names works).

    Override the methods you need; each is called on every rank. ``trainer`` is the run,
    ``pl_module`` the task. ``state_dict()`` (JSON values and tensors) is saved in every
    checkpoint and given back to ``load_state_dict`` when the run resumes; ``state_key``
    names it there (default: the class name; set it when two callbacks of one class keep
    state)."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None: ...
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None: ...
    def on_train_start(self, trainer: Any, pl_module: Any) -> None: ...
    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None: ...
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None: ...
    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None: ...
    def on_after_backward(self, trainer: Any, pl_module: Any) -> None: ...
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None: ...
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None: ...
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None: ...
    def on_validation_epoch_start(self, trainer: Any, pl_module: Any) -> None: ...
    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None: ...
    def on_validation_end(self, trainer: Any, pl_module: Any) -> None: ...
    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None: ...
    def on_train_end(self, trainer: Any, pl_module: Any) -> None: ...
    def on_fit_end(self, trainer: Any, pl_module: Any) -> None: ...
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None: ...
    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


#: Lightning's method names this adapter calls, and the hook each one rides on
LIGHTNING_METHODS = {
    "setup": "distrun_setup_strategy",
    "on_fit_start": "distrun_on_fit_start", "on_train_start": "distrun_on_fit_start",
    "on_train_epoch_start": "distrun_run_epoch",
    "on_train_batch_start": "distrun_training_step",
    "on_before_backward": "distrun_backward", "on_after_backward": "distrun_backward",
    "on_before_optimizer_step": "distrun_optimizer_step",
    "on_train_batch_end": "distrun_on_step_end",
    "on_validation_start": "distrun_run_validation",
    "on_validation_epoch_start": "distrun_run_validation",
    "on_validation_epoch_end": "distrun_run_validation",
    "on_validation_end": "distrun_run_validation",
    "on_train_epoch_end": "distrun_on_epoch_end",
    "on_train_end": "distrun_on_fit_end", "on_fit_end": "distrun_on_fit_end",
    "on_exception": "distrun_on_exception",
    "teardown": "distrun_teardown",
    "state_dict": "distrun_state_dict", "load_state_dict": "distrun_load_state_dict",
}


def _answers(obj: Any, name: str) -> bool:
    """``obj`` has its own ``name`` (not :class:`Callback`'s empty one)."""
    method = getattr(type(obj), name, None)
    if method is None:
        return callable(getattr(obj, name, None))
    return callable(method) and method is not getattr(Callback, name, None)


def is_plugin(obj: Any) -> bool:
    """The object carries hook implementations of its own (``@distrun.hookimpl``)."""
    return any(name.startswith("distrun_") and hasattr(getattr(obj, name, None),
                                                       f"{PROJECT}_impl")
               for name in dir(obj))


# -- the adapter's hook implementations, one per hook, picked per object ---------------------


def _call(self: Any, name: str, run: Any, *args: Any) -> None:
    if name in self.methods:
        getattr(self.callback, name)(run, run.task, *args)


def _setup_strategy(self: Any, run: Any) -> None:
    _call(self, "setup", run, run.stage)


def _on_fit_start(self: Any, run: Any) -> None:
    _call(self, "on_fit_start", run)
    _call(self, "on_train_start", run)


def _run_epoch(self: Any, run: Any, epoch: int) -> Any:
    _call(self, "on_train_epoch_start", run)
    return (yield)


def _training_step(self: Any, run: Any, batch: Any) -> Any:
    self.batch = batch
    _call(self, "on_train_batch_start", run, batch, run.progress.batch_idx)
    return (yield)


def _backward(self: Any, run: Any, loss: Any) -> Any:
    _call(self, "on_before_backward", run, loss)
    result = yield
    _call(self, "on_after_backward", run)
    return result


def _optimizer_step(self: Any, run: Any) -> Any:
    _call(self, "on_before_optimizer_step", run, run.optimizer)
    return (yield)


def _on_step_end(self: Any, run: Any, step: int, metrics: Any) -> None:
    # the batch index of the step's last micro-batch (the loop has moved past it)
    _call(self, "on_train_batch_end", run, dict(metrics), self.batch,
          max(run.progress.batch_idx - 1, 0))


def _run_validation(self: Any, run: Any) -> Any:
    from distrun._train.limits import SANITY_BATCHES

    if run.stash.get(SANITY_BATCHES) is not None:  # the sanity pass: callbacks do not see it
        return (yield)
    _call(self, "on_validation_start", run)
    _call(self, "on_validation_epoch_start", run)
    result = yield
    if result:
        run.metrics.update(result)  # callback_metrics holds this pass's values, as in Lightning
    _call(self, "on_validation_epoch_end", run)
    _call(self, "on_validation_end", run)
    return result


def _on_epoch_end(self: Any, run: Any, epoch: int) -> None:
    _call(self, "on_train_epoch_end", run)


def _on_fit_end(self: Any, run: Any) -> None:
    _call(self, "on_train_end", run)
    _call(self, "on_fit_end", run)


def _on_exception(self: Any, run: Any, exc: BaseException) -> None:
    try:
        _call(self, "on_exception", run, exc)
    except Exception as err:  # the hook must not raise: the run's own error goes first
        log.error("callback %s: on_exception raised %s", self.key, err)


def _teardown(self: Any, run: Any) -> None:
    try:
        _call(self, "teardown", run, run.stage)
    except Exception as err:
        log.error("callback %s: teardown raised %s", self.key, err)


def _state_dict(self: Any, run: Any) -> Any:
    return {self.state_name: self.callback.state_dict()}


def _load_state_dict(self: Any, run: Any, state: Any) -> None:
    if self.state_name in state:
        self.callback.load_state_dict(state[self.state_name])


_IMPLS: dict[str, tuple[Any, dict[str, Any]]] = {
    "distrun_setup_strategy": (_setup_strategy, {}),
    "distrun_on_fit_start": (_on_fit_start, {}),
    "distrun_run_epoch": (_run_epoch, {"wrapper": True}),
    "distrun_training_step": (_training_step, {"wrapper": True}),
    "distrun_backward": (_backward, {"wrapper": True}),
    "distrun_optimizer_step": (_optimizer_step, {"wrapper": True}),
    "distrun_on_step_end": (_on_step_end, {}),
    "distrun_run_validation": (_run_validation, {"wrapper": True}),
    "distrun_on_epoch_end": (_on_epoch_end, {}),
    "distrun_on_fit_end": (_on_fit_end, {}),
    "distrun_on_exception": (_on_exception, {}),
    "distrun_teardown": (_teardown, {}),
    "distrun_state_dict": (_state_dict, {}),
    "distrun_load_state_dict": (_load_state_dict, {}),
}

#: the prefix of a callback's state in checkpoints
STATE_PREFIX = "callback:"


def _adapter(callback: Any, key: str) -> Any:
    """A plugin object calling ``callback``'s Lightning-named methods from distrun's hooks."""
    methods = frozenset(m for m in LIGHTNING_METHODS if _answers(callback, m))
    hooks = {LIGHTNING_METHODS[m] for m in methods}
    if "on_train_batch_end" in methods:
        hooks.add("distrun_training_step")  # keeps the batch it hands on
    namespace: dict[str, Any] = {name: hookimpl(**opts)(fn) for name, (fn, opts) in _IMPLS.items()
                                 if name in hooks}
    adapter = type(f"Callback[{key}]", (), namespace)()
    adapter.callback, adapter.methods, adapter.key, adapter.batch = callback, methods, key, None
    adapter.state_name = STATE_PREFIX + key
    unknown = sorted(n for n in dir(callback) if n.startswith("on_") and n not in methods
                     and n not in LIGHTNING_METHODS and callable(getattr(callback, n, None)))
    if unknown:
        log.warning("warning: callback %s: %s %s never called by distrun (it calls: %s)", key,
                    ", ".join(unknown), "is" if len(unknown) == 1 else "are",
                    ", ".join(m for m in LIGHTNING_METHODS if m.startswith("on_")))
    return adapter


def as_plugins(callbacks: Iterable[Any]) -> list[Any]:
    """The plugin each callback object is registered as, in the given order."""
    plugins: list[Any] = []
    seen: dict[Any, Any] = {}
    for callback in callbacks:
        if isinstance(callback, type):
            raise UsageError(f"callbacks=[...] holds the class {callback.__name__}; pass an "
                             f"instance: {callback.__name__}(...)")
        if is_plugin(callback):
            plugins.append(callback)
            continue
        key = getattr(callback, "state_key", None) or type(callback).__qualname__
        seen[key] = seen.get(key, 0) + 1
        if seen[key] > 1:
            key = f"{key}#{seen[key]}"
        plugins.append(_adapter(callback, str(key)))
    return plugins
