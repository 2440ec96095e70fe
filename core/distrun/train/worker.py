"""``python -m distrun.train.worker``: the entry point of every worker ``distrun run`` starts.

    python -m distrun.train.worker pkg.module:Task [ARGS]   a task, trained by the core's loop
    python -m distrun.train.worker --script PATH [ARGS]     a script, exactly as ``python PATH``
    python -m distrun.train.worker --module NAME [ARGS]     a module, as ``python -m NAME``

Around the target the worker ties itself to its launcher (:mod:`distrun.launch.lifeline`: it
dies within a moment of the launcher's death, however that dies) and, at interpreter exit,
destroys a process group the target left initialized. Without that, torch's gloo threads free
their last work objects while Python finalizes, and the process aborts ("terminate called
without an active exception", exit 134) in a fraction of runs, under torchrun too.
Importing this module does not import torch.
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys
import traceback

from distrun.launch.lifeline import die_with_launcher
from distrun.spec.errors import DistrunError

__all__ = ["destroy_leftover_group", "main"]

_USAGE = ("usage: python -m distrun.train.worker (pkg.module:Task | --script PATH | "
          "--module NAME) [ARGS]")


def destroy_leftover_group() -> None:
    """Destroy the default process group if it is still initialized (local: no collective)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return  # the target never touched torch.distributed
    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - exiting anyway; the exit code stays the target's
        pass


def _run_as_main(run: str, name: str) -> None:
    """Run a script or module as ``__main__``; an uncaught error prints the user's frames."""
    try:
        if run == "--script":
            runpy.run_path(name, run_name="__main__")
        else:
            runpy.run_module(name, run_name="__main__", alter_sys=True)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:  # as Python itself reports it, minus this wrapper's frames
        tb = exc.__traceback__
        # by file, not __name__: under `python -m distrun.train.worker` this module's and the
        # user's script's frames are both "__main__"
        while tb is not None and tb.tb_frame.f_code.co_filename in (
                __file__, runpy.__file__, "<frozen runpy>"):
            tb = tb.tb_next
        traceback.print_exception(type(exc), exc, tb)
        sys.stderr.flush()
        raise SystemExit(1) from None


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] in ("--script", "--module") and len(argv) < 2):
        print(_USAGE, file=sys.stderr)
        raise SystemExit(2)
    die_with_launcher()
    # Registered first, so it runs last: after the target's own exit handlers.
    atexit.register(destroy_leftover_group)
    if argv[0] in ("--script", "--module"):
        run, name, args = argv[0], argv[1], argv[2:]
        sys.argv = [name, *args]
        # what `python PATH` / `python -m NAME` put first on sys.path
        sys.path[0] = os.path.dirname(os.path.abspath(name)) if run == "--script" \
            else os.getcwd()
        _run_as_main(run, name)
        return
    target, args = argv[0], argv[1:]
    sys.argv = [target, *args]
    try:
        from distrun.train.task import load_task

        task = load_task(target)
    except DistrunError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(exc.exit_code) from None
    from distrun.train.trainer import Trainer

    Trainer().fit(task)


if __name__ == "__main__":
    main()
