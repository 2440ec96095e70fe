"""``notebook_launcher``: a function or a distrun Task on N local processes forked from a cell.

Forked, not spawned: what the notebook defined (functions, classes, data already in memory)
is simply there in every rank, nothing is pickled on the way in. Each rank gets exactly the
variables torchrun sets, so ``torch.distributed.init_process_group()`` and ``distrun.fit`` work
inside unchanged. Torch-free at import; torch is looked at only if the kernel already has it.
"""

from __future__ import annotations

import os
import socket
import sys
import uuid
from dataclasses import dataclass, field
from typing import Any

from distrun.plugin import LOOPBACK, UsageError, listen_socket
from distrun_notebook.child import in_launched_process
from distrun_notebook.workers import ForkedRanks

__all__ = ["FitResult", "notebook_launcher"]

#: run-config fields that describe a launch; here the launcher decides them
_LAUNCH_FIELDS = {
    "nproc_per_node": "use num_processes=N",
    "nnodes": "notebook_launcher runs on this machine only",
    "node_rank": "notebook_launcher runs on this machine only",
    "master_addr": "rank 0's store is always on 127.0.0.1",
    "master_port": "a free port is picked for every launch",
}


@dataclass(frozen=True)
class FitResult:
    """What training a Task returns to the kernel (from rank 0)."""

    #: the last reduced values the loop logged: loss, lr, samples_per_sec, epoch, val_*, ...
    metrics: dict[str, float] = field(default_factory=dict)
    step: int = 0
    epoch: int = 0
    #: absolute path of the run folder (config.toml, metrics.csv, checkpoints/)
    run_dir: str = ""


def notebook_launcher(fn_or_task: Any, args: tuple[Any, ...] | list[Any] = (),
                      num_processes: int = 2, *, stop_grace: float = 10.0,
                      show_all_ranks: bool = False, **options: Any) -> Any:
    """Run ``fn(*args)``, or train a distrun Task, on ``num_processes`` forked processes.

    A function returns rank 0's return value (pickled back). A Task (an instance, or a class
    built in each rank as ``Task(*args)``) is trained with ``distrun.fit(task, **options)``
    (``options``: run-config fields such as ``strategy="ddp", max_epochs=2``) and returns a
    :class:`FitResult`. A rank that fails raises :class:`~distrun_notebook.LaunchFailed`
    here; the others get SIGTERM, and SIGKILL 3 s later. Ctrl-C sends every rank SIGINT (a
    Task saves at its next step), SIGKILL after ``stop_grace`` seconds or at a second Ctrl-C,
    and raises KeyboardInterrupt. Rank 0's output and the other ranks' stderr (prefixed
    ``[rank N]``) show in the cell; ``show_all_ranks`` adds the others' stdout.
    ``num_processes=1`` runs in a fork too.
    """
    _check_request(fn_or_task, args, num_processes, stop_grace, options)
    _check_kernel()
    task = _is_task(fn_or_task)
    run_id = uuid.uuid4().hex[:12]
    config: Any = None  # a Task's run config (a function's ranks take none)
    if task:
        config = _task_config(fn_or_task, options, num_processes)
        target = _train_target(fn_or_task, tuple(args), options)
    else:
        target = _call_target(fn_or_task, tuple(args))
    # rank 0's store serves on a socket bound to loopback here (torch's would listen on every
    # interface); the other ranks close their copy, the kernel its own once they ended
    store = _store_socket()
    port = store.getsockname()[1]
    envs = [_rank_env(rank, num_processes, port, run_id, config, store.fileno())
            for rank in range(num_processes)]
    group = ForkedRanks(stop_grace, show_all=show_all_ranks,
                        private_fds={0: [store.fileno()]})
    try:
        return group.run([target] * num_processes, envs)
    except KeyboardInterrupt:
        print(f"notebook_launcher: interrupted; the {num_processes} process"
              f"{'es were' if num_processes > 1 else ' was'} stopped", file=sys.stderr)
        raise
    finally:
        store.close()


# -- refusals (one line each, before anything is forked) --------------------------------------
def _check_request(fn_or_task: Any, args: Any, num_processes: Any, stop_grace: Any,
                   options: dict[str, Any]) -> None:
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) \
            or num_processes < 1:
        raise UsageError(f"num_processes must be a whole number >= 1, got {num_processes!r}")
    if not isinstance(args, (tuple, list)):
        raise UsageError(f"args must be a tuple of arguments, got {type(args).__name__} "
                         "(one argument: args=(value,))")
    if not isinstance(stop_grace, (int, float)) or stop_grace < 0:
        raise UsageError(f"stop_grace must be a number of seconds >= 0, got {stop_grace!r}")
    if _is_task(fn_or_task):
        if args and not isinstance(fn_or_task, type):
            raise UsageError("args are the constructor arguments of a Task class; this Task is "
                             "already built (pass the class, or drop args)")
        for name, why in _LAUNCH_FIELDS.items():
            if name in options:
                raise UsageError(f"{name}= is not a notebook_launcher option: {why}")
        return
    if not callable(fn_or_task):
        raise UsageError(f"notebook_launcher runs a function or a distrun Task, got "
                         f"{type(fn_or_task).__name__}")
    if options:
        names = ", ".join(f"{k}=" for k in options)
        raise UsageError(f"{names}: run options apply when launching a Task; a function gets "
                         "args=(...) (call distrun.fit(task, ...) inside it yourself)")


def _check_kernel() -> None:
    if in_launched_process():
        raise UsageError("notebook_launcher was called inside a process it launched: call it "
                         "from the notebook only")
    if not hasattr(os, "fork"):
        raise UsageError(f"notebook_launcher forks the kernel, which {sys.platform} cannot do: "
                         "run a script with `distrun run --nproc-per-node N` instead")
    torch = sys.modules.get("torch")
    if torch is None:
        return  # nothing torch-related can be set up yet
    if torch.cuda.is_initialized():
        raise UsageError("CUDA is already initialized in this kernel and a forked process "
                         "cannot use it: restart the kernel and keep every CUDA call "
                         "(.cuda(), .to('cuda'), torch.cuda.*) inside the launched code")
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        raise UsageError("a torch.distributed process group exists in this kernel: call "
                         "torch.distributed.destroy_process_group() (or restart the kernel) "
                         "and create process groups only inside the launched code")


def _is_task(obj: Any) -> bool:
    return all(callable(getattr(obj, m, None))
               for m in ("configure_model", "train_data", "training_step"))


# -- what each rank runs ----------------------------------------------------------------------
def _call_target(fn: Any, args: tuple[Any, ...]) -> Any:
    def call() -> Any:
        return fn(*args)

    return call


def _train_target(task: Any, args: tuple[Any, ...], options: dict[str, Any]) -> Any:
    def train() -> FitResult:
        import distrun

        built = task(*args) if isinstance(task, type) else task
        # distrun.fit(built, **options), minus its module-level reuse of the last trainer: a
        # trainer the kernel itself may have left for this task object belongs to the kernel
        run = distrun.Trainer(**options).fit(built)
        return FitResult(metrics={k: float(v) for k, v in run.metrics.items()},
                         step=run.progress.step, epoch=run.progress.epoch,
                         run_dir=os.path.abspath(run.run_dir) if run.run_dir else "")

    return train


def _task_config(task: Any, options: dict[str, Any], num_processes: int) -> Any:
    """Resolve the run config here, as ``distrun run`` does before it starts workers.

    A bad option or an unknown strategy is then one line in the cell, not an error in every
    rank; and the ranks share one fresh run folder (``runs/<notebook>``, ``-2``, ...).
    """
    from distrun.plugin import fresh_run_folder, resolve_run_config

    config = resolve_run_config(options, num_processes)
    if not config.run_dir:
        name = config.name or _notebook_name()
        config = config.with_values(source=config.sources.get("name", "launcher"), name=name)
        config = config.with_values(run_dir=os.path.join("runs", name))
    config = fresh_run_folder(config)
    return config


def _notebook_name() -> str:
    """The notebook's file name when Jupyter says it (JPY_SESSION_NAME), else "notebook"."""
    path = os.environ.get("JPY_SESSION_NAME", "")
    stem = os.path.splitext(os.path.basename(path))[0]
    keep = "".join(c if c.isalnum() or c in "-_." else "-" for c in stem).strip(".-")
    return keep or "notebook"


def _rank_env(rank: int, world: int, port: int, run_id: str, config: Any,
              store_fd: int) -> dict[str, str]:
    """What rank ``rank``'s fork sets in its environment: torchrun's variables (as the
    launcher's worker group gives them), gloo's sockets on loopback, the task's config."""
    from distrun.plugin import NodeRanks

    ranks = NodeRanks(nproc=world, master_addr=LOOPBACK, master_port=port, run_id=run_id,
                      bind=LOOPBACK, config=config)
    return ranks.env(rank, os.environ,
                     {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
                     store_fd=store_fd)


def _store_socket() -> socket.socket:
    """A socket listening on 127.0.0.1 and a free port, for rank 0's store (forked, not
    inherited by what the kernel may start meanwhile)."""
    sock = listen_socket(LOOPBACK, 0)
    sock.set_inheritable(False)
    return sock
