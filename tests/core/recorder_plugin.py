"""A plugin that implements every hook and records each call (hook, rank) as a JSON line.

Loaded with ``DISTRUN_PLUGINS=recorder_plugin`` (this folder on PYTHONPATH); writes to
``$RECORD_DIR/<pid>.jsonl``. Firstresult hooks return None so the core still answers.
"""

from __future__ import annotations

import json
import os
from typing import Any

from distrun.plugin import StashKey, hookimpl

#: the state dict captured at save time, for the test to compare after a restore
SAVED: StashKey[dict[str, Any]] = StashKey("recorder.saved")


def _record(hook: str, **extra) -> None:
    folder = os.environ.get("RECORD_DIR")
    if not folder:
        return
    line = {"hook": hook, "rank": int(os.environ.get("RANK", "-1")), **extra}
    with open(os.path.join(folder, f"{os.getpid()}.jsonl"), "a") as fh:
        fh.write(json.dumps(line) + "\n")


@hookimpl
def distrun_add_commands(cli):
    _record("distrun_add_commands")


@hookimpl
def distrun_register_options(register):
    _record("distrun_register_options")


@hookimpl
def distrun_register_strategies(register):
    _record("distrun_register_strategies")


@hookimpl
def distrun_register_backends(register):
    _record("distrun_register_backends")


@hookimpl
def distrun_resume_words():
    _record("distrun_resume_words")


@hookimpl
def distrun_continues_run(config):
    _record("distrun_continues_run")


@hookimpl
def distrun_parallel_degrees(config):
    _record("distrun_parallel_degrees")


@hookimpl(tryfirst=True)
def distrun_detect_cluster(environ):
    _record("distrun_detect_cluster")


@hookimpl(tryfirst=True)
def distrun_launch(config, command, environ, cluster):
    _record("distrun_launch", cluster=getattr(cluster, "name", None))


@hookimpl
def distrun_node_services(config):
    _record("distrun_node_services")


@hookimpl
def distrun_configure(config):
    _record("distrun_configure")


@hookimpl
def distrun_setup_strategy(run):
    _record("distrun_setup_strategy", strategy=run.strategy.name)


@hookimpl
def distrun_setup_model(run):
    # Plain implementations run before the strategy wraps: the model is the user's module.
    _record("distrun_setup_model", type=type(run.model).__name__)


@hookimpl
def distrun_setup_optimizer(run):
    _record("distrun_setup_optimizer")


@hookimpl
def distrun_setup_data(run):
    _record("distrun_setup_data")


@hookimpl
def distrun_on_fit_start(run):
    _record("distrun_on_fit_start")


@hookimpl(wrapper=True)
def distrun_run_fit(run):
    _record("distrun_run_fit")
    result = yield
    _record("distrun_run_fit:end")
    return result


@hookimpl(wrapper=True)
def distrun_run_epoch(run, epoch):
    _record("distrun_run_epoch", epoch=epoch)
    result = yield
    _record("distrun_run_epoch:end", epoch=epoch)
    return result


@hookimpl
def distrun_training_step(run, batch):
    _record("distrun_training_step")


@hookimpl
def distrun_backward(run, loss):
    _record("distrun_backward")


@hookimpl
def distrun_optimizer_step(run):
    _record("distrun_optimizer_step")


@hookimpl
def distrun_on_step_end(run, step, metrics):
    _record("distrun_on_step_end", step=step)


@hookimpl
def distrun_log_metrics(run, step, metrics):
    _record("distrun_log_metrics", step=step, keys=sorted(metrics))


@hookimpl
def distrun_run_validation(run):
    _record("distrun_run_validation")


@hookimpl
def distrun_on_validation_end(run, step, metrics):
    _record("distrun_on_validation_end", step=step, keys=sorted(metrics))


@hookimpl
def distrun_on_epoch_end(run, epoch):
    _record("distrun_on_epoch_end", epoch=epoch)


@hookimpl
def distrun_state_dict(run):
    _record("distrun_state_dict")
    return {"recorder": {"calls": 1}}


@hookimpl
def distrun_load_state_dict(run, state):
    _record("distrun_load_state_dict", names=sorted(state))


@hookimpl
def distrun_save_checkpoint(run, reason):
    _record("distrun_save_checkpoint", reason=reason)
    # Exercise the state hooks as a checkpoint plugin would.
    run.stash[SAVED] = run.state_dict()


@hookimpl
def distrun_checkpoint_found(run, source):
    _record("distrun_checkpoint_found", source=source)


@hookimpl
def distrun_load_checkpoint(run, source):
    _record("distrun_load_checkpoint", source=source)
    # Round-trip this rank's contributed state through the load hook, as a loader would.
    run.load_state_dict(run.state_dict())


@hookimpl
def distrun_on_exception(run, exc):
    _record("distrun_on_exception", error=str(exc))


@hookimpl
def distrun_on_preempt(run, signum):
    _record("distrun_on_preempt", signum=signum)


@hookimpl
def distrun_on_fit_end(run):
    _record("distrun_on_fit_end")


@hookimpl
def distrun_teardown(run):
    _record("distrun_teardown")
