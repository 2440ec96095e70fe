"""The core's own loop plugin: setup, the loop, backward/step, validation and state.

Registered through the same manager as external plugins (name ``core``). Torch is imported
inside the hooks that run in workers, never at import time.
"""

from __future__ import annotations

from typing import Any

from distrun._spec.markers import hookimpl

# -- worker setup: the strategy wraps in between plain and trylast plugin implementations -----


@hookimpl
def distrun_setup_model(run):
    from distrun._train.build import wrap_model

    wrap_model(run)


@hookimpl
def distrun_setup_optimizer(run):
    from distrun._train.build import build_optimizer

    build_optimizer(run)


@hookimpl
def distrun_setup_data(run):
    from distrun._train.build import build_loaders

    build_loaders(run)


@hookimpl
def distrun_on_fit_start(run):
    from distrun._spec.keys import COMPILE_TIME

    clock = run.stash.get(COMPILE_TIME)
    if clock is not None and not clock.reported:  # --compile: its line after the first step
        from distrun._train.compiling import FirstStep

        run.add_hooks(FirstStep())
    hparams = getattr(run.task, "hparams", None)
    if run.is_global_zero and isinstance(hparams, dict) and hparams and run.run_dir:
        from distrun._train.hparams import write_hparams

        write_hparams(run.run_dir, hparams)
    if run.is_global_zero and run.config.summary:
        from distrun._train.summary import model_summary

        run.log.info(model_summary(run.unwrapped_model()))


# -- the loop ---------------------------------------------------------------------------------


@hookimpl
def distrun_run_fit(run):
    from distrun._train.loop import fit_loop

    return fit_loop(run)


@hookimpl
def distrun_run_epoch(run, epoch):
    from distrun._train.optimizers import is_manual

    if is_manual(run.task):  # the task steps its optimizers (automatic_optimization = False)
        from distrun._train.manual import manual_epoch_loop

        return manual_epoch_loop(run, epoch)
    from distrun._train.loop import epoch_loop

    return epoch_loop(run, epoch)


@hookimpl
def distrun_training_step(run, batch):
    return run.task.training_step(run.model, batch)


@hookimpl
def distrun_backward(run, loss):
    run.strategy.backward(loss)
    return True


@hookimpl
def distrun_optimizer_step(run):
    if run.config.grad_clip > 0:
        run.strategy.clip_grad_norm(run.model, run.config.grad_clip)
    run.strategy.optimizer_step(run.optimizer)
    return True


@hookimpl
def distrun_run_validation(run):
    from distrun._diagnose.position import Phase, marks
    from distrun._train.limits import SANITY_BATCHES
    from distrun._train.stages import evaluate

    rec = marks()
    was = rec.current
    rec.phase(Phase.VALIDATION)  # (the sanity pass's too)
    try:
        return evaluate(run, "validate", limit=run.stash.get(SANITY_BATCHES))
    finally:
        rec.phase(was)


# -- state ------------------------------------------------------------------------------------


@hookimpl(wrapper=True)
def distrun_save_checkpoint(run, reason):
    # The rows of the steps a checkpoint holds are reduced before it is saved, while every
    # rank is there, and logged once it is: a run resumed from it does not train those steps
    # again, and a rank that dies after the commit can no longer keep them from the loggers.
    from distrun._train.step_sync import STEP_SYNC

    sync = run.stash.get(STEP_SYNC)
    if sync is None:
        return (yield)
    try:
        sync.reduce_for_commit()
        return (yield)
    finally:
        sync.log_held()


@hookimpl
def distrun_state_dict(run) -> dict[str, Any]:
    from distrun._train.rng import rng_state

    state: dict[str, Any] = {"progress": run.progress.state_dict(), "rng": rng_state()}
    hparams = getattr(run.task, "hparams", None)
    if isinstance(hparams, dict) and hparams:
        state["hparams"] = dict(hparams)
    if run.sampler is not None:
        state["sampler"] = run.sampler.state_dict()
    if run.schedulers:
        from distrun._train.schedulers import scheduler_states

        state["schedulers"] = scheduler_states(run.schedulers)
    from distrun._train.build import STREAM

    cursor = run.stash.get(STREAM)
    if cursor is not None and cursor.state is not None:
        state["stream"] = cursor.state
    return state


@hookimpl
def distrun_load_state_dict(run, state):
    from distrun._train.rng import set_rng_state

    if "progress" in state:
        run.progress.load_state_dict(state["progress"])
    if "sampler" in state and run.sampler is not None:
        run.sampler.load_state_dict(state["sampler"])
    if "rng" in state:
        set_rng_state(state["rng"])
    from distrun._train.build import STREAM

    cursor = run.stash.get(STREAM)
    if cursor is not None and "stream" in state:
        run.train_loader.load_state_dict(state["stream"])
        cursor.state = state["stream"]
    if run.schedulers:
        from distrun._train.schedulers import load_scheduler_states

        if "schedulers" in state:
            load_scheduler_states(run.schedulers, state["schedulers"])
        elif "lr_scheduler" in state:  # written before distrun 0.2: the first scheduler's
            run.schedulers[0].scheduler.load_state_dict(state["lr_scheduler"])


