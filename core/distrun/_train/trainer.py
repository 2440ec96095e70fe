"""``Trainer``: builds the run config and the run, then drives the hooks in order."""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import sys
import threading
from typing import Any, ClassVar, NoReturn, cast

from distrun._config.run_config import CONFIG_ENV, RunConfig, resolve_config
from distrun._launch.failure_note import read_note
from distrun._launch.folder_lock import lock_run_folders, release_all, run_key
from distrun._registry.collect import check_consumed, collect_options
from distrun._registry.manager import make_plugin_manager
from distrun._spec.errors import DistrunError, UsageError
from distrun._spec.keys import COMPILE_TIME
from distrun._train.failures import TRAINING, classify, stopped_for_failure
from distrun._train.run import EXIT_REQUEUE, Run
from distrun._train.skip_init import check_loaded
from distrun._train.unread_args import warn_unread_argv

__all__ = ["Trainer", "worker_config"]

log = logging.getLogger("distrun")
#: stop requests: save at an agreed step boundary and exit (143; 130 for SIGINT, whose second
#: arrival interrupts at once, as Ctrl-C twice does)
_STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")


def worker_config(pm: Any, code: dict[str, Any] | None = None) -> RunConfig:
    """The config of this worker: the launcher's values (``DISTRUN_CONFIG``), env, code."""
    inherited, sources = None, None
    if os.environ.get(CONFIG_ENV):
        payload = json.loads(os.environ[CONFIG_ENV])
        inherited, sources = payload["values"], payload.get("sources")
    config = resolve_config(collect_options(pm), code=code, inherited=inherited,
                            inherited_sources=sources, pluginmanager=pm)
    if not config.run_dir:
        from distrun._config.run_config import with_values
        from distrun._config.run_dir import fresh_run_folder

        name = config.name or _script_name()
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
        if not config.name and int(os.environ.get("WORLD_SIZE", "1")) > 1 and run_id \
                and config.resume == "never":
            # started by torchrun: the ranks share its run id, not a view of the folders
            name = f"{name}-{run_id[:8]}"
        config = with_values(config, name=name, run_dir=os.path.join("runs", name))
        if CONFIG_ENV not in os.environ and int(os.environ.get("WORLD_SIZE", "1")) == 1:
            config = fresh_run_folder(config)  # `python train.py` again: a new folder
    return config


def _script_name() -> str:
    """The run's default name: the script's, or the notebook's inside a Jupyter kernel."""
    name = os.path.splitext(os.path.basename(sys.argv[0] or "run"))[0]
    if name == "ipykernel_launcher":
        session = os.environ.get("JPY_SESSION_NAME", "")
        name = os.path.splitext(os.path.basename(session))[0] or "notebook"
    return name


def _setup_logging(rank: int) -> None:
    """Rank 0 says INFO, the others only warnings. Records still propagate, so an app's own
    logging setup (or pytest's caplog) sees them; our plain stdout handler is added only when
    nobody configured logging."""
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.propagate = False


class Trainer:
    """Train and evaluate a task: ``Trainer(max_epochs=3, batch_size=64).fit(task)``.

    Keyword arguments are run-config fields and plugin options; flags, ``DISTRUN_*`` variables
    and the ``--config`` file of ``distrun run`` take precedence over them. ``callbacks`` are
    objects (see :mod:`distrun._train.callbacks`): plugins with ``@hookimpl`` methods, or
    objects with Lightning's method names; each is registered as a plugin for the session.

    After :meth:`fit`, :meth:`validate`, :meth:`test` and :meth:`predict` run in the same
    processes on the trained model (the process group stays up until :meth:`close`, another
    trainer starts, or the process exits). Called first, they build the model and load
    ``ckpt_path`` (or ``--resume``) into it.
    """

    #: the trainer whose session holds this process's process group. torch has one default
    #: group per process, so one session is open at a time: opening another closes this one.
    _open: ClassVar[Trainer | None] = None

    def __init__(self, config: RunConfig | None = None, plugins: tuple[Any, ...] = (),
                 plugin_manager: Any = None, callbacks: Any = (), **options: Any) -> None:
        from distrun._train.callbacks import as_plugins

        self._config = config
        self._options = options
        self._plugins = plugins
        #: the callback objects as plugins (registered for each session, unregistered at close)
        self._callbacks = as_plugins(callbacks or ())
        #: this trainer's plugins (built from the environment's settings on first use:
        #: entry points, DISTRUN_PLUGINS, DISTRUN_BLOCK_PLUGINS); never a process global
        self._pm = plugin_manager
        self._run: Run | None = None  # the open session: its strategy and model are live
        self._locks: list[Any] = []  # rank 0's locks on the run's folders (launch.folder_lock)

    # -- the stages -------------------------------------------------------------------------
    def fit(self, task: Any, datamodule: Any = None) -> Run:
        """Run the stages ``--stage`` names (``fit`` by default) and return the :class:`Run`;
        each stage's result is in ``run.results[stage]``. ``datamodule``: a
        :class:`distrun.DataModule` whose data methods win over the task's."""
        run = self._session(task, datamodule=datamodule)
        for stage in run.config.stage.split(","):
            self._stage(run, stage)
        return run

    def validate(self, task: Any = None, ckpt_path: str | None = None,
                 datamodule: Any = None) -> dict[str, float]:
        """Validation metrics (``val_*``), reduced over ranks, on every rank."""
        return cast(dict, self._one(task, "validate", ckpt_path, datamodule))

    def test(self, task: Any = None, ckpt_path: str | None = None,
             datamodule: Any = None) -> dict[str, float]:
        """Test metrics (``test_*``) over ``task.test_data()``, reduced over ranks."""
        return cast(dict, self._one(task, "test", ckpt_path, datamodule))

    def predict(self, task: Any = None, ckpt_path: str | None = None,
                datamodule: Any = None) -> Any:
        """``predict_step`` outputs over ``task.predict_data()`` in dataset order (or, with
        ``predictions="write"``, the folder of each rank's files)."""
        return self._one(task, "predict", ckpt_path, datamodule)

    def close(self) -> None:
        """End the session: the strategy tears down (the process group it made is destroyed)."""
        run, self._run = self._run, None
        if Trainer._open is self:
            Trainer._open = None
            atexit.unregister(self.close)
        for plugin in self._callbacks:
            if self._pm is not None and self._pm.is_registered(plugin):
                self._pm.unregister(plugin)
        try:
            if run is not None:
                clock = run.stash.get(COMPILE_TIME)
                if clock is not None:
                    clock.close()  # dynamo's callbacks stop calling this run's clock
            if run is not None and run.strategy is not None:
                run.strategy.teardown()
        finally:
            release_all(self._locks)
            self._locks = []

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------
    def _one(self, task: Any, stage: str, ckpt_path: str | None, datamodule: Any = None) -> Any:
        run = self._session(task, stage, datamodule)
        self._stage(run, stage, ckpt_path)
        return run.results.get(stage)

    def _session(self, task: Any, stage: str | None = None, datamodule: Any = None) -> Run:
        """The open run for ``task`` (None: the last one), or a new one set up for it."""
        if self._run is not None and (task is None or task is self._run.task):
            if datamodule is not None:
                self._run.datamodule = datamodule
            return self._run
        if task is None:
            raise UsageError(f"Trainer.{stage}() needs the task: trainer.{stage}(task) (or fit "
                             "it first with this trainer)")
        if Trainer._open is not None:
            Trainer._open.close()  # one live process group at a time
        self.close()
        _setup_logging(int(os.environ.get("RANK", "0")))
        try:
            if self._pm is None:
                self._pm = (self._config.pluginmanager if self._config is not None else None) \
                    or make_plugin_manager()
            pm = self._pm
            for plugin in (*self._plugins, *self._callbacks):
                if not pm.is_registered(plugin):
                    pm.register(plugin)
            from distrun._train.limits import apply_fast_dev_run

            config = apply_fast_dev_run(self._config or worker_config(pm, self._options))
            check_consumed(pm, collect_options(pm), config)
            if int(os.environ.get("RANK", "0")) == 0:  # one process per run takes them
                self._locks = lock_run_folders(config, collect_options(pm), run_key())
                warn_unread_argv(config, collect_options(pm))
            if stage is not None:
                from distrun._config.run_config import with_values

                config = with_values(config, stage=stage)
            # a plugin may refuse the config here, and rank 0 writes the run folder's config
            pm.hook.distrun_configure.call_historic(kwargs=dict(config=config))
        except DistrunError as exc:
            _exit_on_error(exc, debug=bool(self._options.get("debug")))
        try:
            self._run = Run(config, task, pm)
        except DistrunError as exc:
            _exit_on_error(exc, debug=config.debug)
        self._run.datamodule = datamodule
        Trainer._open = self
        # closed at exit, before the interpreter finalizes (see distrun._worker.main)
        atexit.register(self.close)
        return self._run

    def _stage(self, run: Run, stage: str, ckpt_path: str | None = None) -> None:
        body = _Body()
        previous = _install_stop_handlers(run, body)
        pm, config = run.pm, run.config
        failed = True
        try:
            body.running = True
            run.stage = stage
            if run.strategy is None:
                from distrun._train.loop import setup_run

                setup_run(run)
            if run.strategy.trains:
                if stage == "fit":
                    self._fit(run)
                else:
                    run.results[stage] = self._evaluate(run, stage, ckpt_path)
                    from distrun._train.compiling import say_compiled

                    say_compiled(run, stage)  # --compile: its line, unless a fit said it
            failed = False
        except DistrunError as exc:
            body.running = False
            pm.hook.distrun_on_exception(run=run, exc=exc)
            _exit_on_error(exc, debug=config.debug)
        except BaseException as exc:
            body.running = False
            pm.hook.distrun_on_exception(run=run, exc=exc)
            error = classify(exc, run)  # a failure torch reports its own way: one line
            if error is not None:
                _exit_on_error(error, debug=config.debug)
            raise
        finally:
            body.running = False
            try:
                pm.hook.distrun_teardown(run=run)  # a stop signal now must not cut it short
            finally:
                _restore_handlers(previous)
                run.remove_scoped_hooks()
                stopped = run.stop_signal is not None and run.done
                if failed or stopped or (run.strategy is not None and not run.strategy.trains):
                    self.close()
        if run.stop_signal is not None and run.done:
            sys.exit(128 + signal.SIGINT if run.stop_signal == signal.SIGINT else EXIT_REQUEUE)

    def _fit(self, run: Run) -> None:
        if run.config.resume != "never" and not run.stash.get(TRAINING):
            run.resumed_from = run.hook.distrun_load_checkpoint(run=run, source=run.config.resume)
            check_loaded(run)
            if run.resumed_from:
                log.info("Resumed from %s at step %d", run.resumed_from, run.progress.step)
        run.done = run.stop_requested = False  # a second fit of this session starts afresh
        run.hook.distrun_on_fit_start(run=run)
        from distrun._train.limits import sanity_check

        sanity_check(run)
        run.stash[TRAINING] = True
        run.hook.distrun_run_fit(run=run)
        if run.stop_signal is not None and run.done:
            log.warning("Stop signal %d: saving a checkpoint and exiting for requeue",
                        run.stop_signal)
            run.hook.distrun_on_preempt(run=run, signum=run.stop_signal)
            run.save_checkpoint("preempt")
            return
        run.hook.distrun_on_fit_end(run=run)
        run.results["fit"] = dict(run.metrics)

    def _evaluate(self, run: Run, stage: str, ckpt_path: str | None) -> Any:
        source = ckpt_path or (run.config.resume if not run.stash.get(TRAINING)
                               and run.resumed_from is None else None)
        if source and source != "never":
            loaded = run.hook.distrun_load_checkpoint(run=run, source=source)
            if loaded:
                run.resumed_from = loaded
                log.info("%s: loaded %s (step %d)", stage, loaded, run.progress.step)
        elif not run.stash.get(TRAINING) and run.resumed_from is None:
            log.warning("warning: %s runs on the model as configure_model() made it (no "
                        "checkpoint was loaded: pass --resume PATH or ckpt_path=...)", stage)
        from distrun._train.stages import evaluate, predict

        if stage == "predict":
            return predict(run)
        from distrun._train.loop import validate

        if stage == "validate":
            return dict(validate(run))
        metrics = evaluate(run, stage)
        if metrics:
            run.metrics.update(metrics)
            run.hook.distrun_log_metrics(run=run, step=run.progress.step, metrics=dict(metrics))
        return metrics


def _exit_on_error(exc: DistrunError, debug: bool) -> NoReturn:
    if debug:
        raise exc
    sys.stderr.write(f"error: {exc}\n")
    raise SystemExit(exc.exit_code)


class _Body:
    """Whether a stage's body runs (not yet its error handling or teardown): the only time a
    stop signal may raise in it."""

    running = False


def _install_stop_handlers(run: Run, body: _Body) -> dict[int, Any]:
    """SIGTERM, SIGINT, SIGUSR1: a stop at the next step boundary (SIGINT twice: at once).
    A SIGTERM whose launcher noted that another rank failed ends the step at once: without
    that rank it cannot finish (:mod:`distrun._launch.failure_note`)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}

    def on_stop(signum: int, frame: Any) -> None:
        if run.state.held_signals is not None:  # handled at the end of the held block
            run.state.held_signals.append(signum)
            return
        if signum == signal.SIGINT and run.stop_signal is not None:
            raise KeyboardInterrupt
        run.stop_signal = signum
        if signum == signal.SIGTERM and body.running:
            note = read_note()
            if note is not None:
                body.running = False
                if note.code == UsageError.exit_code:
                    raise SystemExit(note.code)  # the other rank's one line says it all
                raise stopped_for_failure(run, note)

    for name in _STOP_SIGNALS:
        sig = getattr(signal, name, None)
        if sig is not None:
            previous[sig] = signal.signal(sig, on_stop)
    return previous


def _restore_handlers(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)
