"""The model of a resume, built without its random initialization.

A resume overwrites every tensor of the model's state with the checkpoint's, so the random
draws ``configure_model()`` makes for them (``nn.Linear``'s ``kaiming_uniform_``, a task's
``weight.normal_()``) are thrown away: 0.38 s of a 100M-parameter restart on the CPU, a
third of what a restart from the memory tier spends before its first step. When the
checkpoint plugin says, before the model is built, that the load will restore a checkpoint
that exists now (``distrun_checkpoint_found``), the core builds the model under
:class:`SkipInit`: torch's initializers and the in-place random and fill methods of tensors
leave their tensor as it is (uninitialized memory, as Lightning's
``init_module(empty_init=True)`` does on request).

What is skipped is always overwritten:

- every skipped tensor must be (part of) a tensor of the model's ``state_dict``: one that is
  not (a buffer drawn at random but not saved, a tensor the task keeps itself) would keep its
  uninitialized memory, so the model is then built again the ordinary way, from the same
  seed;
- the load is strict (a checkpoint without one of the model's tensors is refused) and a fit
  whose plugin promised a load and loaded nothing is an error (:func:`check_loaded`), never a
  fresh start from uninitialized memory;
- the checkpoint restores the RNG states, so the draws after the load are those of an
  ordinary resume.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode

from distrun._spec.errors import DistrunError
from distrun._spec.stash import StashKey
from distrun._train.failures import TRAINING
from distrun._train.rng import seed_everything
from distrun._train.run import Run

__all__ = ["SKIPPED_INIT", "SkipInit", "build_model", "check_loaded", "covered"]

#: set when the run's model was built with its initialization skipped
SKIPPED_INIT: StashKey[bool] = StashKey("skip_init.skipped")

#: the in-place methods that fill a tensor with random draws or a constant; torch.nn.init's
#: functions end in them, and the four that dispatch themselves are caught by their module
_FILLS = frozenset(getattr(torch.Tensor, name) for name in (
    "uniform_", "normal_", "random_", "bernoulli_", "exponential_", "log_normal_", "cauchy_",
    "geometric_", "fill_", "zero_"))


class SkipInit(TorchFunctionMode):
    """Within it, torch's initializers and the fills of :data:`_FILLS` return their tensor
    untouched; :attr:`skipped` holds a weak reference to the storage of each."""

    def __init__(self) -> None:
        super().__init__()
        self.skipped: list[StorageWeakRef] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _FILLS or getattr(func, "__module__", None) == "torch.nn.init":
            tensor = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if type(tensor) in (torch.Tensor, torch.nn.Parameter):
                if tensor.numel():
                    self.skipped.append(StorageWeakRef(tensor.untyped_storage()))
                return tensor
        return func(*args, **kwargs)


def covered(model: torch.nn.Module, skipped: list[StorageWeakRef]) -> bool:
    """Whether every storage of ``skipped`` still in use is that of a tensor of ``model``'s
    ``state_dict`` (what a strict load overwrites). One no longer in use was a temporary
    (``orthogonal_`` draws into one, then copies its result into the weight)."""
    state = {StorageWeakRef(t.untyped_storage()).cdata
             for t in model.state_dict(keep_vars=True).values()
             if type(t) in (torch.Tensor, torch.nn.Parameter)}
    return all(ref.expired() or ref.cdata in state for ref in skipped)


def _resumes(run: Run) -> bool:
    """Whether this build precedes a load that will restore a checkpoint (see the module)."""
    if run.stage != "fit" or run.config.resume == "never" or run.stash.get(TRAINING):
        return False
    return bool(run.hook.distrun_checkpoint_found(run=run, source=run.config.resume))


def build_model(run: Run) -> Any:
    """``run.task.configure_model()``, its initialization skipped before a load that will
    restore every tensor of it (see the module)."""
    if not _resumes(run):
        return run.task.configure_model()
    with SkipInit() as mode:
        model = run.task.configure_model()
    if isinstance(model, torch.nn.Module) and covered(model, mode.skipped):
        run.stash[SKIPPED_INIT] = True
        return model
    del model
    seed_everything(run.config.seed)  # the RNG as the first build found it
    return run.task.configure_model()


def check_loaded(run: Run) -> None:
    """After the fit's load: a model built uninitialized must have been loaded."""
    if run.stash.get(SKIPPED_INIT) and not run.resumed_from:
        raise DistrunError(
            "the checkpoint plugin said a checkpoint would be loaded (distrun_checkpoint_found) "
            "but its load restored none, so the model holds uninitialized memory: this is a "
            "plugin bug; resume with --resume never to start afresh")
    run.stash.pop(SKIPPED_INIT, None)
