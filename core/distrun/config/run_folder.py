"""The run folder ``runs/<name>/``: the resolved config, per-rank logs, metrics, checkpoints.

``--name`` and ``--run-dir`` choose it. The launcher of node 0 (or rank 0 of a run started
without ``distrun run``) writes ``config.toml``: every option with the source of its value,
loadable again with ``--config``. The local launcher appends each
worker's output to ``logs/rank<N>.log``; ``metrics.csv`` comes from :mod:`distrun.loggers.csv_file`
and checkpoints go to ``checkpoints/``.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from typing import Any

from distrun.spec.markers import hookimpl

__all__ = ["CONFIG_FILE", "LOG_DIR", "config_options", "fill_code_values", "render_config",
           "value_sources", "write_config"]

CONFIG_FILE = "config.toml"
LOG_DIR = "logs"


def value_sources(config: Any) -> dict[str, str]:
    """Where each value came from: the launcher's record beats the worker's "launcher" label."""
    from distrun.config.run_config import CONFIG_ENV

    sources = dict(config.sources)
    raw = os.environ.get(CONFIG_ENV)
    if raw:
        try:
            launcher = json.loads(raw).get("sources", {})
        except ValueError:
            launcher = {}
        for name, source in launcher.items():
            if sources.get(name) in (None, "launcher"):
                sources[name] = source
    return sources


def config_options(config: Any) -> list[Any]:
    """Option declarations for rendering ``config`` without calling any hook again.

    Core fields keep their help and order; plugin options are listed under "plugins" (a
    worker has their values, not their declarations, and must not re-run
    ``distrun_register_options``).
    """
    from distrun.config.run_config import core_options
    from distrun.spec.options import Option

    core = core_options()
    names = {o.name for o in core}
    return core + [Option(name=n, plugin="plugins") for n in config.plugin_options
                   if n not in names]


def render_config(config: Any, options: list[Any] | None = None, header: str = "") -> str:
    """``config`` as TOML with each value's source (see :func:`distrun.cli.config_cmd.render_toml`)."""
    from distrun.cli.config_cmd import render_toml

    options = config_options(config) if options is None else options
    return render_toml(options, config.as_dict(), value_sources(config), header=header)


def write_config(config: Any, path: str, options: list[Any] | None = None) -> None:
    """Write ``config`` as TOML with sources to ``path`` (atomically)."""
    command = " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]])
    header = (f"Resolved config of run {config.name!r}, written "
              f"{time.strftime('%Y-%m-%d %H:%M:%S')}\ncommand: {command}\n"
              f"Each value's source follows it; defaults are commented out. Load again "
              f"with `distrun run --config {path} ...`.")
    text = render_config(config, options, header=header)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


@hookimpl(wrapper=True)
def distrun_launch(config, command, environ):
    # The launcher knows every value's source, and runs for torchrun scripts too.
    if config.node_rank == 0 and config.run_dir:
        from distrun.registry.collect import collect_options
        from distrun.registry.manager import get_plugin_manager

        # The launcher has the declarations: group plugin options by plugin, with help.
        options = collect_options(get_plugin_manager())
        write_config(config, os.path.join(config.run_dir, CONFIG_FILE), options)
    return (yield)


def fill_code_values(config: Any, path: str) -> None:
    """Mark in the launcher's ``config.toml`` the values the task gave in code.

    The launcher cannot see ``Trainer(max_epochs=3)``; rank 0 rewrites those lines in place.
    """
    from distrun.cli.config_cmd import toml_value

    code = {name for name, source in config.sources.items() if source == "code"}
    if not code or not os.path.exists(path):
        return
    with open(path) as fh:
        lines = fh.read().splitlines()
    for i, line in enumerate(lines):
        match = re.match(r"^(?:# )?(\w+) = ", line)
        literal = toml_value(config.get(match.group(1))) if match and match.group(1) in code \
            else None
        if literal is not None:
            lines[i] = f"{match.group(1)} = {literal}  # code"
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    os.replace(tmp, path)


@hookimpl
def distrun_configure(config):
    from distrun.config.run_config import CONFIG_ENV

    if int(os.environ.get("RANK", "0")) != 0 or not config.run_dir:
        return
    path = os.path.join(config.run_dir, CONFIG_FILE)
    if CONFIG_ENV in os.environ:  # launched: the launcher wrote it; add values set in code
        fill_code_values(config, path)
    else:  # `python train.py`: nobody else will write it
        write_config(config, path)
