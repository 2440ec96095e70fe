"""Which run folder a run gets: a fresh one beside earlier runs, and one that can be made.

Torch-free; nothing here creates a folder (the launcher makes it when the run starts).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from distrun._config.run_config import RunConfig, with_values
from distrun._spec.errors import UsageError

__all__ = ["check_run_dir", "fresh_run_folder"]


def check_run_dir(run_dir: str) -> None:
    """Refuse, in one line, a run folder that cannot be made: a file stands in its way.

    The nearest part of ``run_dir`` that exists must be a folder (a symlink to one counts).
    A folder that cannot be written into for another reason (permissions, ``/proc``) is said
    when the launcher makes it (:func:`distrun._launch.folder_lock.make_folder`).
    """
    probe = os.path.abspath(run_dir)
    while not os.path.lexists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            return
        probe = parent
    if os.path.isdir(probe):
        return
    if probe == os.path.abspath(run_dir):
        raise UsageError(f"the run folder {run_dir} is a file, not a folder (move it away, or "
                         "choose another --run-dir or --name)")
    shown = os.path.relpath(probe) if not os.path.isabs(run_dir) else probe
    raise UsageError(f"cannot make the run folder {run_dir}: {shown} is a file, not a folder "
                     "(choose another --run-dir)")


def _continues(config: RunConfig) -> bool:
    """True when the run picks up an earlier one in the same folder (its checkpoints)."""
    if config.resume != "never":
        return True
    # a plugin whose runs resume every start from the folder (restarts) says so
    pm = config.pluginmanager
    return pm is not None and any(pm.hook.distrun_continues_run(config=config))


def fresh_run_folder(config: RunConfig, say: bool = False) -> RunConfig:
    """``config`` with a run folder no earlier run has written into.

    A folder that exists and holds anything belongs to an earlier run: this one gets
    ``NAME-2`` (``-3``, ...) beside it, unless it continues that run (``--resume`` other than
    never, or restarts). ``say`` prints one line about the move. A run folder that cannot
    be made is a :class:`UsageError` (see :func:`check_run_dir`).
    """
    run_dir = config.run_dir
    if not run_dir:
        return config
    check_run_dir(run_dir)
    if _continues(config) or not _used(run_dir):
        return config
    n = 2
    while _used(f"{run_dir}-{n}"):
        n += 1
    values: dict[str, Any] = {"run_dir": f"{run_dir}-{n}"}
    if config.name and os.path.basename(os.path.normpath(run_dir)) == config.name:
        values["name"] = f"{config.name}-{n}"
    if say:
        print(f"distrun: {run_dir} holds an earlier run; this run writes {values['run_dir']} "
              "(--resume auto continues the earlier one)", file=sys.stderr, flush=True)
    sources = {k: config.sources.get(k, "launcher") for k in values}
    out = config
    for key, value in values.items():
        out = with_values(out, source=sources[key], **{key: value})
    return out


def _used(path: str) -> bool:
    """True when ``path`` exists and is not an empty folder (an earlier run's, or in the way).

    ``check_run_dir`` made sure the parent is a folder, so the numbering above ends at the
    first name that does not exist. Any other refusal (a name too long, a parent that cannot
    be searched) would refuse every next number too: it is a :class:`UsageError`, not "taken".
    """
    try:
        return bool(os.listdir(path))
    except FileNotFoundError:
        return False
    except NotADirectoryError:  # a file in the way
        return True
    except OSError as exc:
        if isinstance(exc, PermissionError) and os.path.lexists(path):
            return True  # a folder we may not list: someone's, so taken
        shown = path if len(path) <= 80 else f"{path[:40]}...{path[-30:]}"
        raise UsageError(f"cannot use the run folder {shown}: {exc.strerror or exc} (choose "
                         "another --run-dir or --name)") from None
