"""``distrun config init`` (a commented TOML template) and ``distrun config show``.

``show`` resolves the config exactly as ``distrun run`` would (flags > env > file > default)
and prints every value with where it came from; the run folder's ``config.toml`` uses the
same rendering.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from typing import Any

import click

from distrun._config.toml_file import render_toml, template_toml
from distrun._spec.markers import hookimpl

__all__ = ["render_toml", "template_toml"]


def _resolve(pm: Any, config_file: str | None, flags: Mapping[str, Any]) -> Any:
    """The config as ``distrun run`` resolves it in the launcher, minus the run target."""
    from distrun._config.run_config import resolve_config
    from distrun._registry.collect import apply_cluster_env, collect_options, detect_cluster

    config = resolve_config(collect_options(pm), flags=flags, config_file=config_file,
                            pluginmanager=pm)
    config = apply_cluster_env(config, detect_cluster(pm, os.environ))
    return config


def _config_group(pm: Any) -> click.Group:
    from distrun._cli.main import _option_to_click
    from distrun._registry.collect import collect_options

    options = collect_options(pm)

    @click.group("config")
    def config_cmd() -> None:
        """Write a config template, or show the resolved config and its sources."""

    @config_cmd.command("init")
    @click.option("-o", "--output", default="run.toml", show_default=True,
                  help="file to write ('-' for stdout)")
    @click.option("--force", is_flag=True, help="overwrite an existing file")
    def init_cmd(output: str, force: bool) -> None:
        """Write a commented TOML template of every installed option."""
        from distrun._spec.errors import UsageError

        text = template_toml(options)
        if output == "-":
            click.echo(text, nl=False)
            return
        if os.path.exists(output) and not force:
            raise UsageError(f"{output} exists (pass --force to overwrite it, or -o OTHER.toml)")
        tmp = f"{output}.tmp{os.getpid()}"
        try:  # whole or not at all: a half template would load as a different config
            with open(tmp, "w") as fh:
                fh.write(text)
            os.replace(tmp, output)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise UsageError(f"cannot write {output}: {exc.strerror or exc} (choose another "
                             "-o path, or -o - to print it)") from None
        click.echo(f"wrote {output} ({len(options)} options); use it with "
                   f"`distrun run --config {output} ...`")

    @config_cmd.command("show")
    @click.option("--config", "config_file", type=click.Path(), default=None,
                  help="TOML file of run options")
    @click.option("--json", "as_json", is_flag=True, help="machine-readable output")
    def show_cmd(config_file: str | None, as_json: bool, **flags: Any) -> None:
        """Print the resolved config and where each value came from."""
        flags = {k: v for k, v in flags.items() if v is not None}
        config = _resolve(pm, config_file, flags)
        values = config.as_dict()
        if as_json:
            out = {name: {"value": values.get(name), "source": config.sources.get(name,
                                                                                  "default")}
                   for name in (o.name for o in options)}
            click.echo(json.dumps(out, indent=2, default=str))
            return
        click.echo(render_toml(options, values, config.sources), nl=False)

    for opt in options:
        click_opt = _option_to_click(opt)
        click_opt.name = opt.name
        show_cmd.params.append(click_opt)
    return config_cmd


@hookimpl
def distrun_add_commands(cli, pluginmanager):
    cli.add_command(_config_group(pluginmanager))
