"""``Trainer``: builds the run config and the run, then drives the hooks in order."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from distrun.config.run_config import CONFIG_ENV, RunConfig, resolve_config
from distrun.registry.collect import collect_options
from distrun.registry.manager import get_plugin_manager
from distrun.spec.errors import DistrunError
from distrun.spec.stash import StashKey
from distrun.train.run import EXIT_REQUEUE, Run

__all__ = ["Trainer", "worker_config"]

log = logging.getLogger("distrun")
#: stop requests: save at an agreed step boundary and exit (143; 130 for SIGINT, whose second
#: arrival interrupts at once, as Ctrl-C twice does)
_STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")
#: set once the loop starts: a timeout before that is a rank stuck before training
_TRAINING: StashKey[bool] = StashKey("trainer.training")


def worker_config(pm: Any, code: dict[str, Any] | None = None) -> RunConfig:
    """The config of this worker: the launcher's values (``DISTRUN_CONFIG``), env, code."""
    inherited, sources = None, None
    if os.environ.get(CONFIG_ENV):
        payload = json.loads(os.environ[CONFIG_ENV])
        inherited, sources = payload["values"], payload.get("sources")
    config = resolve_config(collect_options(pm), code=code, inherited=inherited,
                            inherited_sources=sources)
    if not config.run_dir:
        from distrun.config.run_config import fresh_run_folder, with_values

        name = config.name or os.path.splitext(os.path.basename(sys.argv[0] or "run"))[0]
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
        if not config.name and int(os.environ.get("WORLD_SIZE", "1")) > 1 and run_id \
                and config.resume == "never":
            # started by torchrun: the ranks share its run id, not a view of the folders
            name = f"{name}-{run_id[:8]}"
        config = with_values(config, name=name, run_dir=os.path.join("runs", name))
        if CONFIG_ENV not in os.environ and int(os.environ.get("WORLD_SIZE", "1")) == 1:
            config = fresh_run_folder(config)  # `python train.py` again: a new folder
    return config


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
    """Train a task: ``Trainer(max_epochs=3, batch_size=64).fit(task)``.

    Keyword arguments are run-config fields and plugin options; flags, ``DISTRUN_*`` variables
    and the ``--config`` file of ``distrun run`` take precedence over them.
    """

    def __init__(self, config: RunConfig | None = None, plugins: tuple[Any, ...] = (),
                 **options: Any) -> None:
        self._config = config
        self._options = options
        self._plugins = plugins

    def fit(self, task: Any) -> Run:
        """Run setup, restore, the loop and teardown; return the finished :class:`Run`."""
        _setup_logging(int(os.environ.get("RANK", "0")))
        try:
            pm = get_plugin_manager()
            for plugin in self._plugins:
                if not pm.is_registered(plugin):
                    pm.register(plugin)
            config = self._config or worker_config(pm, self._options)
        except DistrunError as exc:
            _exit_on_error(exc, debug=bool(self._options.get("debug")))
        pm.hook.distrun_configure.call_historic(kwargs=dict(config=config))
        run = Run(config, task, pm)
        previous = _install_stop_handlers(run)
        try:
            self._fit(run)
        except DistrunError as exc:
            pm.hook.distrun_on_exception(run=run, exc=exc)
            _exit_on_error(exc, debug=config.debug)
        except BaseException as exc:
            pm.hook.distrun_on_exception(run=run, exc=exc)
            if _is_collective_timeout(exc, run):
                _exit_on_error(DistrunError(_timeout_message(run)), debug=config.debug)
            if _is_lost_peer(exc, run):
                _exit_on_error(DistrunError(_lost_peer_message(run, exc)), debug=config.debug)
            raise
        finally:
            _restore_handlers(previous)
            try:
                pm.hook.distrun_teardown(run=run)
            finally:
                run.remove_scoped_hooks()
                if run.strategy is not None:
                    run.strategy.teardown()
        if run.stop_signal is not None and run.done:
            sys.exit(128 + signal.SIGINT if run.stop_signal == signal.SIGINT else EXIT_REQUEUE)
        return run

    def _fit(self, run: Run) -> None:
        from distrun.train.loop import setup_run

        setup_run(run)
        if not run.strategy.trains:
            return  # this rank served the trainers during strategy.setup and is done
        if run.config.resume != "never":
            run.resumed_from = run.hook.distrun_load_checkpoint(run=run, source=run.config.resume)
            if run.resumed_from:
                log.info("Resumed from %s at step %d", run.resumed_from, run.progress.step)
        run.hook.distrun_on_fit_start(run=run)
        run.stash[_TRAINING] = True
        run.hook.distrun_run_fit(run=run)
        if run.stop_signal is not None and run.done:
            log.warning("Stop signal %d: saving a checkpoint and exiting for requeue",
                        run.stop_signal)
            run.hook.distrun_on_preempt(run=run, signum=run.stop_signal)
            run.save_checkpoint("preempt")
            return
        run.hook.distrun_on_fit_end(run=run)


def _exit_on_error(exc: DistrunError, debug: bool) -> None:
    if debug:
        raise exc
    print(f"error: {exc}", file=sys.stderr, flush=True)
    raise SystemExit(exc.exit_code)


#: where torch raises a failed collective: c10d calls, DDP's reducer, autograd's backward
_COLLECTIVE_MODULES = ("torch.distributed", "torch.nn.parallel", "torch.autograd")


def _is_collective_timeout(exc: BaseException, run: Run) -> bool:
    """A collective that waited out ``--timeout``: told by type and origin, never by text.

    Gloo reports a timeout as a plain ``RuntimeError``; it counts when it was raised inside
    torch's collective code after the run had waited at least the timeout since its last step.
    """
    if run.world_size < 2:
        return False
    if isinstance(exc, (TimeoutError, _dist_error())):
        return True
    if not isinstance(exc, RuntimeError) or not _raised_in(exc, _COLLECTIVE_MODULES):
        return False
    return time.monotonic() - run.progress.step_started >= run.config.timeout * 0.9


#: seconds a rank whose collective failed waits for its launcher's stop signal
_PEER_GRACE = 3.0


def _is_lost_peer(exc: BaseException, run: Run) -> bool:
    """A collective that failed because another rank stopped, told by evidence, not text.

    When a rank fails, every launcher (distrun's, the elastic agent, torchrun) stops the others
    with SIGTERM. So a ``RuntimeError`` from collective code counts as a lost peer only once
    that signal arrived; an error of the rank's own (DDP's unused parameters...) gets no
    signal and keeps its traceback.
    """
    if run.world_size < 2 or not isinstance(exc, RuntimeError) \
            or not _raised_in(exc, (*_COLLECTIVE_MODULES, "distrun.train.step_sync")):
        return False
    deadline = time.monotonic() + _PEER_GRACE
    while run.stop_signal is None and time.monotonic() < deadline:
        time.sleep(0.02)  # the signal handler runs between these sleeps
    return run.stop_signal is not None


def _lost_peer_message(run: Run, exc: BaseException) -> str:
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    return (f"rank {run.rank}: a collective failed at step {run.progress.step} because "
            f"another rank stopped (its error is above; --debug shows this rank's traceback): "
            f"{first[:200]}")


def _dist_error() -> type[BaseException]:
    import torch.distributed as dist

    return getattr(dist, "DistError", TimeoutError)


def _raised_in(exc: BaseException, prefixes: tuple[str, ...]) -> bool:
    tb = exc.__traceback__
    while tb is not None:
        module = tb.tb_frame.f_globals.get("__name__", "")
        if module.startswith(prefixes):
            return True
        tb = tb.tb_next
    return False


def _timeout_message(run: Run) -> str:
    if not run.stash.get(_TRAINING):
        return (f"rank {run.rank}: waited {run.config.timeout:g}s for the other ranks before "
                "training started: a rank is stuck before training (at import, in setup or "
                "loading data) or never started; see the other ranks' output, or change the "
                "limit with --timeout SECONDS or DISTRUN_TIMEOUT")
    return (f"rank {run.rank}: a collective timed out after {run.config.timeout:g}s: the ranks "
            "are out of step (most often uneven inputs: one rank ran out of batches while the "
            "others wait for it; pip install distrun-join, or give every rank the same number "
            "of batches); change the limit with --timeout SECONDS or DISTRUN_TIMEOUT")


def _install_stop_handlers(run: Run) -> dict[int, Any]:
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}

    def on_stop(signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and run.stop_signal is not None:
            raise KeyboardInterrupt
        run.stop_signal = signum

    for name in _STOP_SIGNALS:
        sig = getattr(signal, name, None)
        if sig is not None:
            previous[sig] = signal.signal(sig, on_stop)
    return previous


def _restore_handlers(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)
