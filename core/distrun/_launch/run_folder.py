"""The run folder ``runs/<name>/``: the resolved config, per-rank logs, metrics, checkpoints.

``--name`` and ``--run-dir`` choose it; an existing folder of an earlier run is never written
into again (the run gets ``NAME-2``) unless the run continues it (``--resume``). A plain
torchrun script gets no folder unless one is asked for (``--name``, ``--run-dir``; ``--log-dir``
puts only the logs somewhere); a Task does. The launcher of node 0 (or rank 0 when the launcher made no
folder, or without ``distrun run``) writes ``config.toml``: every option with the source of its value,
loadable again with ``--config``. The local launcher appends each
worker's output to ``logs/rank<N>.log``; ``metrics.csv`` comes from :mod:`distrun._loggers.csv_file`
and checkpoints go to ``checkpoints/``.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from distrun._launch.folder_lock import (
    RUN_KEY_ENV,
    first_missing,
    lock_run_folders,
    make_folder,
    release_all,
    remove_empty,
    run_key,
)
from distrun._registry.manager import manager_of
from distrun._spec.errors import DistrunError
from distrun._spec.markers import hookimpl

__all__ = ["CONFIG_FILE", "LOG_DIR", "add_code_values", "write_config"]

CONFIG_FILE = "config.toml"
LOG_DIR = "logs"
#: set by the launcher for its workers when it could not write ``config.toml`` (and said so):
#: rank 0 then does not try, and warn, again
_UNWRITTEN_ENV = "DISTRUN_CONFIG_TOML_UNWRITTEN"


def write_config(config: Any, path: str, options: list[Any] | None = None) -> None:
    """Write ``config`` as TOML with sources to ``path`` (atomically)."""
    command = " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]])
    header = (f"Resolved config of run {config.name!r}, written "
              f"{time.strftime('%Y-%m-%d %H:%M:%S')}\ncommand: {command}\n"
              f"Each value's source follows it; defaults are commented out. Load again "
              f"with `distrun run --config {path} ...`.")
    _write_atomic(path, config.to_toml(options, header=header))


@hookimpl(wrapper=True)
def distrun_launch(config, command, environ, cluster):
    """Lock the run's folders, write ``config.toml``, launch; undo both if it never started.

    The launcher knows every value's source, and runs for torchrun scripts too. A launch that
    a launcher refuses (a busy port, a node range without the elastic plugin) raises before any
    worker starts: what was made for it is removed, so a rejected run leaves no folder.
    """
    from distrun._registry.collect import collect_options

    # The launcher has the declarations: group plugin options by plugin, with help.
    options = collect_options(manager_of(config))
    locks = []
    if owns_folders(config, cluster):
        locks = lock_run_folders(config, options, environ.get(RUN_KEY_ENV) or run_key())
    written, before, made = None, None, None
    started = False
    try:
        if config.node_rank == 0 and config.run_dir:
            made = first_missing(config.run_dir)
            path = os.path.join(config.run_dir, CONFIG_FILE)
            before = _read(path)  # a run it continues wrote one
            if _saved(lambda: write_config(config, path, options), path):
                written = path
            else:
                environ[_UNWRITTEN_ENV] = "1"
        result = yield
        started = True
        return result
    except DistrunError:
        if written is not None:  # refused before any worker started: as it was
            _restore(written, before)
        raise
    finally:
        release_all(locks, abandon=not started)
        if not started and made is not None:
            remove_empty(config.run_dir, made)


def owns_folders(config: Any, cluster: Any) -> bool:
    """True when this launcher holds the run's folder locks: it alone runs the run's node.

    Across nodes, or with one launcher per rank (srun, mpirun), rank 0's worker holds them.
    """
    from distrun._launch.local import per_process_cluster

    return config.nnodes in ("1", "1:1") and per_process_cluster(config, cluster) is None


def _read(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return None


def _restore(path: str, text: str | None) -> None:
    """Put ``path`` back as it was: ``text``, or no file."""
    try:
        if text is None:
            os.unlink(path)
        else:
            _write_atomic(path, text)
    except OSError:
        pass


def _header(path: str) -> str:
    """The comment block that opens the file at ``path`` (the launcher's command and time)."""
    lines = []
    with open(path) as fh:
        for line in fh:
            if not line.startswith("#"):
                break
            lines.append(line[2:].rstrip("\n"))
    return "\n".join(lines)


def add_code_values(config: Any, path: str) -> None:
    """Write the launcher's ``config.toml`` again with the values the task gave in code.

    The launcher cannot see ``Trainer(max_epochs=3)``; rank 0 renders the whole file again
    from its own config, which carries the launcher's sources, and keeps the launcher's header.
    """
    if "code" not in config.sources.values() or not os.path.exists(path):
        return
    from distrun._registry.collect import collect_options

    text = config.to_toml(collect_options(manager_of(config)), header=_header(path))
    _write_atomic(path, text)


def _write_atomic(path: str, text: str) -> None:
    """``path`` holds ``text`` whole, or is as it was: the temporary goes on any failure."""
    make_folder(os.path.dirname(path) or ".")
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _saved(write: Any, path: str) -> bool:
    """Run ``write`` (of ``config.toml`` at ``path``); on a system refusal (a full disk, a
    read-only folder) say one warning and return False.

    ``config.toml`` is a record of the options (for people, and for ``--config``): no process
    of the run reads it, so a run whose folder cannot take it trains on without it, as it does
    when its logs and metrics cannot be written.
    """
    try:
        write()
    except OSError as exc:
        sys.stderr.write(f"warning: cannot write {path}: {exc.strerror or exc}; the run goes "
                         "on without this record of its options (free space there, or choose "
                         "another --run-dir)\n")
        sys.stderr.flush()
        return False
    return True


@hookimpl
def distrun_configure(config):
    from distrun._config.run_config import CONFIG_ENV

    if int(os.environ.get("RANK", "0")) != 0 or not config.run_dir:
        return
    path = os.path.join(config.run_dir, CONFIG_FILE)
    if CONFIG_ENV in os.environ and os.environ.get(_UNWRITTEN_ENV):
        return  # the launcher could not write it, and said so
    if CONFIG_ENV in os.environ and os.path.exists(path):
        # launched: the launcher wrote it; add values from code
        _saved(lambda: add_code_values(config, path), path)
    else:  # `python train.py`, or a script the launcher gave no folder: a Task wants one
        _saved(lambda: write_config(config, path), path)
