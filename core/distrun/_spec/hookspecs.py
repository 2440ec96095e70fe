"""Every hook distrun calls, grouped by the phase of a run in which it is called.

Conventions (as in pytest and pluggy):

- Hooks are called with keyword arguments only; an implementation may take fewer arguments
  than its spec ("opt-in arguments"), so specs can grow without breaking plugins.
- ``firstresult`` hooks stop at the first non-None result.
- "Wrappers" are ``@hookimpl(wrapper=True)`` generator functions around the core's own
  implementation (``yield`` runs the inner hooks and returns their result).
- ``run`` is the :class:`distrun._train.run.Run` of this worker: ``run.config``, ``run.task``,
  ``run.strategy``, ``run.model``, ``run.optimizer``, ``run.train_loader``, ``run.progress``,
  ``run.rank``, ``run.world_size``, ``run.is_global_zero``, ``run.run_dir``, and
  ``run.generation``: the rendezvous round of an elastic run (it grows with every round and is
  the same on every rank of one; 0 outside the elastic agent; ``DISTRUN_RDZV_GENERATION``).
  What is fixed for the session (``config``, ``task``, ``pm``, ``hook``, ``generation``,
  ``run_dir``, ``log``) is read-only (``run.fixed``, frozen); what the loop changes
  (``progress``, ``metrics``, ``done``, ``stop_requested``, ``stop_signal``) lives in
  ``run.state``; the setup hooks may replace the model, optimizer, scheduler and loaders.

Call order. In the launcher: ``add_commands``, ``register_options``, ``register_strategies``,
``register_backends`` (building the CLI), then ``detect_cluster``, then ``launch`` (whose
worker groups ask ``config.node_services()``). In each
worker (``register_backends`` when the strategy makes its process group)::

    register_options -> configure -> register_strategies -> [register_backends]
    -> setup_strategy -> [checkpoint_found] -> setup_model
    -> setup_optimizer -> setup_data -> [load_checkpoint -> load_state_dict]
    -> on_fit_start -> run_fit(
         run_epoch( (training_step -> backward) x grad_accum -> optimizer_step
                    -> on_step_end -> [log_metrics] -> [run_validation
                    -> on_validation_end -> log_metrics] ... )
         -> [run_validation -> on_validation_end -> log_metrics] -> on_epoch_end ... )
    -> on_fit_end | (on_preempt -> save_checkpoint -> state_dict) | on_exception
    -> teardown

The other stages (``run.stage``: ``validate``, ``test``, ``predict``; ``--stage`` or
``Trainer.validate/test/predict``) run after a fit in the same session (no setup again) or
on their own (setup without training data, then ``[load_checkpoint -> load_state_dict]``);
then ``run_validation -> on_validation_end -> log_metrics`` (validate), ``log_metrics``
(test) or nothing (predict), and ``teardown``. ``on_fit_start`` is not called for them: a
logger opens its file at its first ``log_metrics`` too.

``parallel_degrees`` and ``resume_words`` are questions, not phases: they are asked wherever
a strategy or the launcher reads the run's parallel degrees, and wherever a config is
resolved (``--resume`` is checked against the words).

Hooks of phase 1 run in the launcher process (no torch imported, no process group). All the
others run in every worker process on every rank unless the docstring says otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from distrun._spec.markers import hookspec

if TYPE_CHECKING:
    import click
    import pluggy
    import torch

    from distrun._config.run_config import RunConfig
    from distrun._spec.backends import BackendInfo
    from distrun._spec.cluster import ClusterEnv
    from distrun._spec.node import NodeService
    from distrun._spec.options import Option, PluginOptions
    from distrun._spec.strategy import StrategyInfo
    from distrun._train.run import Run


# -------------------------------------------------------------------------------------------
# Phase 1: the launcher process (`distrun ...` on each node). Must not import torch.
# -------------------------------------------------------------------------------------------


@hookspec
def distrun_add_commands(cli: click.Group, pluginmanager: pluggy.PluginManager) -> None:
    """Add subcommands to the ``distrun`` command line.

    Called once when the CLI is built, in the launcher process. Any number of plugins.

    :param cli: the root ``click.Group``; call ``cli.add_command(...)``.
    :param pluginmanager: the manager of this command line's plugins (a command that lists
        or resolves options asks it).
    """


@hookspec
def distrun_register_options(register: Callable[[Option | type[PluginOptions]], None]) -> None:
    """Declare run options (a flag, a TOML key and a ``DISTRUN_*`` variable each).

    Called once per process that builds a run config (launcher and workers). Any number of
    plugins; option names must be unique across plugins (prefix them with the plugin name).

    :param register: call ``register(MyOptions)`` with the plugin's
        :class:`~distrun._spec.options.PluginOptions` class (each field is an option), or
        ``register(Option(...))`` for one option.
    """


@hookspec
def distrun_register_strategies(register: Callable[[StrategyInfo], None]) -> None:
    """Offer strategies by name (``--strategy NAME``).

    Called in the launcher (to validate and list names, without building anything) and in each
    worker (to build the chosen one). Any number of plugins; names must be unique.

    :param register: call ``register(StrategyInfo(name, factory, ...))``; ``factory`` may
        import torch, it is called only in workers.
    """


@hookspec
def distrun_register_backends(register: Callable[[BackendInfo], None]) -> None:
    """Offer communication backends by name (``--backend NAME``, or ``cpu:NAME,cuda:OTHER``).

    Called in the launcher (to validate and list names; nothing may import torch here), in
    each worker (to check and load the chosen ones before the process group is made) and by
    ``distrun env``. Any number of plugins; names must be unique. The core offers torch's own
    ``gloo``, ``nccl`` and ``mpi`` through this hook too.

    :param register: call ``register(BackendInfo(name, devices, check, load, ...))``.
    """


@hookspec
def distrun_resume_words() -> Mapping[str, str] | None:
    """Name the words ``--resume`` takes that this plugin's checkpoints give a meaning to.

    Called wherever a run config is resolved (launcher and workers), to check ``--resume``
    and to list its words in ``--help``. The core's own words are ``never``, ``auto`` and
    ``latest``; anything else is a path unless a plugin names it here (the checkpoint plugin's
    ``best``). The plugin that names a word reads it in ``distrun_load_checkpoint``. Any number
    of plugins; a word named twice is a plugin bug.

    :return: word -> what it loads (one phrase, shown in ``--help``), or None for none.
    """


@hookspec
def distrun_continues_run(config: RunConfig) -> bool | None:
    """Say whether this run, by this plugin's options, continues the run its folder holds.

    Called when the launcher picks the run folder: a folder that holds an earlier run gets
    ``NAME-2`` beside it unless ``--resume`` asks for that run's checkpoints or a plugin answers
    True here (the elastic plugin under ``--max-restarts``: every start resumes from the
    folder's checkpoints, a requeued job included). Any number of plugins; one True is enough.
    Torch-free.

    :return: True to keep the folder, or None.
    """


@hookspec
def distrun_parallel_degrees(config: RunConfig) -> Mapping[str, int] | None:
    """Say which parallel degrees this plugin's options ask for (``{"tp": 2}``).

    Called when a strategy reads the run's degrees (``config.parallel_degrees()``): in
    the launcher, which checks the layout before any worker starts,
    and in each worker. The plugin that owns a parallel dimension publishes its degree here,
    so a strategy that composes with it (fsdp's dp x tp mesh) reads a fact, never that
    plugin's option. Any number of plugins; a degree named by two plugins is a plugin bug.
    Torch-free.

    :param config: the run config.
    :return: degree name (``"tp"``, ``"pp"``, ...) -> degree >= 1, or None for none.
    """


@hookspec(firstresult=True)
def distrun_detect_cluster(environ: Mapping[str, str]) -> ClusterEnv | None:
    """Recognise the cluster environment the launcher runs in (SLURM, Kubernetes, MPI, ...).

    Called once by ``distrun run`` and ``distrun env`` in the launcher. Stops at first non-None
    result; the core's plain-environment implementation runs last and always answers.

    :param environ: the launcher's environment variables.
    :return: a :class:`~distrun._spec.cluster.ClusterEnv`, or None when not recognised.
    """


@hookspec(firstresult=True)
def distrun_launch(config: RunConfig, command: list[str], environ: dict[str, str],
                   cluster: ClusterEnv | None) -> int | None:
    """Start the workers of this node, wait for them and return the exit code.

    Called once by ``distrun run`` in the launcher. Stops at first non-None result: a launcher
    plugin (elastic, ray) answers when the config asks for it (e.g. ``max_restarts > 0``) and
    returns None otherwise; the core's local launcher runs last.

    :param config: the resolved run config (``config.nproc_per_node`` etc.).
    :param command: the worker command line (``python -u -m distrun._worker.main`` and the
        target with its arguments).
    :param environ: the base environment for workers (``DISTRUN_CONFIG`` included); the launcher
        adds torchrun's variables per worker.
    :param cluster: what ``distrun_detect_cluster`` answered for this launch (asked once, in
        the launcher, before the config was resolved).
    :return: the exit code of the run (the first failing worker's, else 0).
    """


@hookspec
def distrun_node_services(config: RunConfig) -> NodeService | None:
    """A service to run beside this node's ranks, or None.

    Asked in the launcher by each worker group the launcher makes (the local launcher, the
    elastic agent, distrun-ft's replica groups), before its first start. The group calls the
    service's ``started(group)`` after each start of its workers and ``ended(group)`` once they
    have all ended (a restart is an end, then a start); a service's ``worker_env(group)``, when
    it has one, gives variables to every worker of each start. Must not import torch.

    :param config: the resolved run config.
    :return: a :class:`~distrun.plugin.NodeService`, or None to add nothing for this run.
    """


# -------------------------------------------------------------------------------------------
# Phase 2: worker setup. Every rank, in this order.
# -------------------------------------------------------------------------------------------


@hookspec(historic=True)
def distrun_configure(config: RunConfig) -> None:
    """See the resolved run config once it is final.

    Historic: a plugin registered later still gets the call. Every worker, every rank; any
    number of plugins. Raise :class:`distrun.UsageError` to reject an option combination.
    """


@hookspec
def distrun_setup_strategy(run: Run) -> None:
    """The strategy has set up the process group, device and mesh; look, don't replace.

    Every rank, once, after ``run.strategy.setup(run)``. Any number of plugins.
    """


@hookspec
def distrun_setup_model(run: Run) -> None:
    """Change ``run.model`` (replace it or modify it in place).

    Every rank, once. Any number of plugins, in pluggy order: the core's implementation (which
    lets the strategy wrap the model: DDP, FSDP, TP) runs after plain and ``tryfirst``
    implementations and before ``trylast`` ones. So activation checkpointing goes plain, and a
    wrapper that must see the parallel model (``torch.compile``) goes ``trylast``.
    """


@hookspec
def distrun_setup_optimizer(run: Run) -> None:
    """Change ``run.optimizer`` (and ``run.lr_scheduler``); same order rules as setup_model.

    Every rank, once, after setup_model. The core's implementation builds the optimizer from
    ``task.configure_optimizer(params)`` if none is set yet, then lets the strategy wrap it.
    """


@hookspec
def distrun_setup_data(run: Run) -> None:
    """Change ``run.train_loader`` / ``run.val_loader``; same order rules as setup_model.

    Every rank, once, after setup_optimizer. The core's implementation builds the loaders with
    the resumable distributed sampler (``run.sampler``) from ``task.train_data()``.
    """


# -------------------------------------------------------------------------------------------
# Phase 3: the loop. Wrap the fit, each epoch and each step; observe steps and validation.
# -------------------------------------------------------------------------------------------


@hookspec
def distrun_on_fit_start(run: Run) -> None:
    """Setup is done (and any checkpoint restored); training is about to start.

    Every rank, once. Any number of plugins (progress bars open here, on rank 0).
    """


@hookspec(firstresult=True)
def distrun_run_fit(run: Run) -> Any:
    """Run the whole training loop; the core implements it, plugins wrap it.

    Every rank, once. Stops at first non-None result (the core returns ``run.progress``).
    Wrap with ``@hookimpl(wrapper=True)`` to time or profile the fit.
    """


@hookspec(firstresult=True)
def distrun_run_epoch(run: Run, epoch: int) -> Any:
    """Run one epoch of training steps; the core implements it, plugins wrap it.

    Every rank, once per epoch. Stops at first non-None result. The join plugin wraps this in
    ``torch.distributed.algorithms.Join``.

    :param epoch: the epoch number, from 0.
    """


@hookspec(firstresult=True)
def distrun_training_step(run: Run, batch: Any) -> torch.Tensor | None:
    """Compute the loss of one micro-batch (forward only); the core calls the task.

    Every rank, every micro-batch. Stops at first non-None result. Wrappers change how the
    forward runs (autocast for mixed precision). The per-step hooks are the loop's hot path: a
    plugin that only sometimes takes part registers them for the fit with
    ``run.add_hooks(obj)`` when it applies (as distrun-amp and distrun-tp do), so an installed
    but unused plugin costs the loop nothing.

    :return: the scalar loss to back-propagate.
    """


@hookspec(firstresult=True)
def distrun_backward(run: Run, loss: torch.Tensor) -> bool | None:
    """Back-propagate ``loss`` (already divided by the accumulation count).

    Every rank, every micro-batch (under manual optimization: every
    ``task.manual_backward(loss)``). Stops at first non-None result; the core's implementation
    calls ``run.strategy.backward(loss)``; a gradient scaler answers first when active.
    :return: True when handled.
    """


@hookspec(firstresult=True)
def distrun_optimizer_step(run: Run) -> bool | None:
    """Apply the optimizer step (gradients are complete on every rank).

    Every rank, every optimizer step. Stops at first non-None result; the core's
    implementation clips gradients (``grad_clip``) and calls the strategy's step. Under
    manual optimization the task's ``opt.step()`` calls it, with ``run.optimizer`` that
    optimizer and ``run.model`` a module of its parameters for the call.
    :return: True when handled.
    """


@hookspec
def distrun_on_step_end(run: Run, step: int, metrics: Mapping[str, Any]) -> None:
    """An optimizer step finished.

    Every rank, every optimizer step, any number of plugins. Keep it cheap: it is on the hot
    path. ``metrics`` holds this rank's unreduced values (``loss`` as a tensor); reduced values
    come through ``distrun_log_metrics``. Checkpoint cadence and progress bars live here.

    :param step: the global optimizer step just completed (1-based).
    """


@hookspec
def distrun_log_metrics(run: Run, step: int, metrics: Mapping[str, float]) -> None:
    """Metrics reduced across ranks are ready (every ``log_every_n_steps`` and after validation).

    Every rank with the same values; loggers write on ``run.is_global_zero`` only. Any number.
    Also after each epoch that logged ``on_epoch`` values, and for the ``test`` stage.

    :param metrics: plain floats: ``loss``, ``lr``, ``samples_per_sec``, ``epoch``, ``val_*``,
        ``test_*`` and what the steps log. A fresh dict per call: a wrapper
        (``@hookimpl(wrapper=True)``) may add entries before its ``yield`` and every logger
        sees them in the same row (distrun-lr-monitor adds the learning rates so).
    """


@hookspec(firstresult=True)
def distrun_run_validation(run: Run) -> Mapping[str, float] | None:
    """Run validation over ``run.val_loader`` and return metrics reduced across ranks.

    Every rank, every ``val_every_n_steps`` and at the end of each epoch when the task has
    validation data, and in the ``validate`` stage (``run.stage``); also once before training
    for the sanity pass over the first ``num_sanity_val_steps`` batches, whose result nothing
    logs (a wrapper that sets up a context, such as autocast, applies there too). Stops at
    first non-None result; the core implements it (sample-weighted means, each sample counted
    once).
    """


@hookspec
def distrun_on_validation_end(run: Run, step: int, metrics: Mapping[str, float]) -> None:
    """Validation finished with these reduced metrics. Every rank, any number of plugins."""


@hookspec
def distrun_on_epoch_end(run: Run, epoch: int) -> None:
    """An epoch of training finished. Every rank, any number of plugins."""


# -------------------------------------------------------------------------------------------
# Phase 4: state. Contribute named state to checkpoints; write and read them.
# -------------------------------------------------------------------------------------------


@hookspec
def distrun_state_dict(run: Run) -> Mapping[str, Any] | None:
    """Contribute state to the next checkpoint, under names of your own.

    Every rank, when a checkpoint is written. Any number of plugins; each returns
    ``{name: state}`` (names unique across plugins; the core contributes ``progress``,
    ``sampler`` and ``rng``). States are JSON-able values and tensors.
    """


@hookspec
def distrun_load_state_dict(run: Run, state: Mapping[str, Any]) -> None:
    """Take back your named state from a restored checkpoint.

    Every rank, after model and optimizer were restored. Any number of plugins; each reads its
    own names from ``state`` (a missing name means the checkpoint predates the plugin).
    """


@hookspec(firstresult=True)
def distrun_save_checkpoint(run: Run, reason: str) -> str | None:
    """Write a checkpoint of the whole run now; every rank takes part.

    Called by ``run.save_checkpoint(reason)`` on every rank together (cadence, preemption, end,
    user request). Stops at first non-None result: exactly one checkpoint plugin answers.

    :param reason: ``"step"``, ``"epoch"``, ``"preempt"``, ``"end"``, ``"user"``, ``"best"``
        or ``"callback"`` (a checkpoint callback object's).
    :return: the path of the committed checkpoint.
    """


@hookspec(firstresult=True)
def distrun_checkpoint_found(run: Run, source: str) -> bool | None:
    """Say, before the model is built, whether ``distrun_load_checkpoint(run, source)`` will
    restore a checkpoint: one exists now.

    Called on every rank after the strategy's setup (the process group exists), for a fit
    whose ``config.resume`` is not ``never``; the answer must be the same on every rank. True
    is a promise: the load restores every tensor of the model's ``state_dict`` (a checkpoint
    that lacks one is refused) or raises. The core then builds the model without its random
    initialization, which the load would overwrite (:mod:`distrun._train.skip_init`). Stops
    at the first non-None result.

    :return: True when the load will restore a checkpoint; False or None when it may not.
    """


@hookspec(firstresult=True)
def distrun_load_checkpoint(run: Run, source: str) -> str | None:
    """Restore model, optimizer and contributed state from a checkpoint; every rank.

    Called at setup, before ``distrun_on_fit_start``, when ``config.resume`` is not ``never``.
    Stops at first non-None result.

    :param source: ``"auto"`` (newest valid checkpoint of this run, if any), ``"latest"`` (the
        same, but an error when there is none), ``"best"`` (the best by the monitored metric,
        when the plugin keeps such) or a path.
    :return: the path loaded, or None when there was nothing to load.
    """


# -------------------------------------------------------------------------------------------
# Phase 5: failure and teardown.
# -------------------------------------------------------------------------------------------


@hookspec
def distrun_on_exception(run: Run, exc: BaseException) -> None:
    """The loop raised ``exc`` on this rank; called before the error propagates.

    Every rank on which it happened. Any number of plugins. Do not raise.
    """


@hookspec
def distrun_on_preempt(run: Run, signum: int) -> None:
    """A stop signal (SIGTERM/SIGUSR1) reached the workers; all ranks stop together.

    Every rank, at the first step boundary where all ranks have seen the signal. Any number of
    plugins. The core then saves a checkpoint (``reason="preempt"``) and exits with code
    :data:`distrun._train.run.EXIT_REQUEUE`.
    """


@hookspec
def distrun_on_fit_end(run: Run) -> None:
    """Training ended normally (max epochs or max steps reached). Every rank, any number."""


@hookspec
def distrun_teardown(run: Run) -> None:
    """The run is over, normally or not: release files, threads and bars.

    Every rank, always (from a ``finally``), before the strategy tears down the process group.
    Any number of plugins. Do not raise.
    """
