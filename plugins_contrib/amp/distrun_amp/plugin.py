"""Entry point of distrun-amp: mixed precision through the step hooks (torch-free import).

``--precision bf16-mixed`` runs each training step (and validation) under ``torch.autocast``
in bfloat16, on CPU and CUDA. ``--precision 16-mixed`` uses float16 with a ``GradScaler`` on
CUDA: it answers ``distrun_backward`` (scaled loss) and ``distrun_optimizer_step`` (unscale,
clip, step, update) before the core, and its scaler state rides in checkpoints.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distrun.plugin import (
    StashKey,
    UsageError,
    hookimpl,
    keys,
)
from distrun_amp.options import AmpOptions

if TYPE_CHECKING:
    from distrun_amp.precision import MixedPrecision

DISTRUN_PLUGIN_API = 1  # the distrun.plugin API this plugin is written for

#: the run's autocast/GradScaler state, for plugins that need the scaler
AMP: StashKey[MixedPrecision] = StashKey("amp")
STATE_NAME = "amp_scaler"


@hookimpl
def distrun_register_options(register):
    register(AmpOptions)


@hookimpl
def distrun_setup_strategy(run):
    precision = AmpOptions.of(run.config).precision
    if precision == "32-true":
        return
    from distrun_amp.precision import MixedPrecision

    amp = run.stash[AMP] = MixedPrecision(precision, run.device)
    dims = run.stash.get(keys.PARALLEL_DIMS)
    if amp.scaler is not None and dims is not None and dims.pp > 1:
        raise UsageError(f"--precision {precision} scales the loss for backward "
                         "with a GradScaler, which a pipeline schedule's own backward does not "
                         "do; use --precision bf16-mixed (or 32-true) with pipeline parallel")
    run.add_hooks(Autocast(amp))
    if amp.scaler is not None:
        run.add_hooks(ScaledSteps(amp))


class Autocast:
    """Steps and validation under ``torch.autocast`` (registered for a mixed-precision fit
    only: a 32-bit run's steps never pass here)."""

    def __init__(self, amp: MixedPrecision) -> None:
        self.amp = amp

    @hookimpl(wrapper=True)
    def distrun_training_step(self, run, batch):
        with self.amp.autocast():
            loss = yield
        return self.amp.loss_to_float(loss)

    @hookimpl(wrapper=True)
    def distrun_run_validation(self, run):
        with self.amp.autocast():
            return (yield)


class ScaledSteps:
    """16-mixed: the loss scaled before backward; unscale, clip, step and update the scaler."""

    def __init__(self, amp: MixedPrecision) -> None:
        self.amp = amp

    @hookimpl(tryfirst=True)
    def distrun_backward(self, run, loss):
        run.strategy.backward(self.amp.scaler.scale(loss))
        return True

    @hookimpl(tryfirst=True)
    def distrun_optimizer_step(self, run):
        self.amp.scaled_step(run)
        return True


@hookimpl
def distrun_state_dict(run):
    amp = run.stash.get(AMP)
    if amp is None or amp.scaler is None:
        return None
    return {STATE_NAME: amp.scaler.state_dict()}


@hookimpl
def distrun_load_state_dict(run, state):
    amp = run.stash.get(AMP)
    if amp is not None and amp.scaler is not None and STATE_NAME in state:
        amp.scaler.load_state_dict(dict(state[STATE_NAME]))
