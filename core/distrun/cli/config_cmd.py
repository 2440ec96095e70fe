"""``distrun config init`` (a commented TOML template) and ``distrun config show``.

``show`` resolves the config exactly as ``distrun run`` would (flags > env > file > default)
and prints every value with where it came from; the run folder's ``config.toml`` uses the
same rendering.
"""

from __future__ import annotations

import json
import os
import textwrap
from collections.abc import Iterable, Mapping
from typing import Any

import click

from distrun.spec.markers import hookimpl
from distrun.spec.options import Option

__all__ = ["render_toml", "template_toml", "toml_value"]


def toml_value(value: Any) -> str | None:
    """``value`` as a TOML literal, or None when TOML cannot say it (None, objects)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # JSON string escapes are valid TOML basic-string escapes
    return None


def _groups(options: Iterable[Option]) -> dict[str, list[Option]]:
    groups: dict[str, list[Option]] = {}
    for opt in options:
        groups.setdefault(opt.plugin, []).append(opt)
    return groups


def _comment(text: str) -> str:
    return "\n".join(f"# {line}".rstrip() for line in text.splitlines() or [""])


def template_toml(options: Iterable[Option]) -> str:
    """A TOML file with every option commented out at its default, grouped by plugin."""
    lines = [
        "# distrun run config: `distrun run --config run.toml ...`.",
        "# Precedence: command-line flag > DISTRUN_* variable > this file > default.",
        "# Uncomment a key to set it. Keys of plugins not installed are rejected.",
    ]
    for plugin, opts in _groups(options).items():
        lines += ["", f"# ---- {plugin} " + "-" * max(3, 80 - len(plugin) - 8)]
        for opt in opts:
            if opt.hidden:
                continue
            help_text = opt.help
            if opt.choices:
                help_text += f" (one of: {', '.join(map(str, opt.choices))})"
            text = f"{help_text}  [{opt.flag}, {opt.env_var}]"
            lines.append(_comment("\n".join(textwrap.wrap(text, 90))))
            value = toml_value(opt.default)
            lines.append(f"# {opt.name} = {value if value is not None else ''}".rstrip())
    return "\n".join(lines) + "\n"


def render_toml(options: Iterable[Option], values: Mapping[str, Any],
                sources: Mapping[str, str], header: str = "") -> str:
    """Every option's value with its source as a trailing comment, grouped by plugin.

    Defaults and values TOML cannot hold (None) are written commented out, so the file loads
    back with ``--config`` to the same run: it pins only what was set, and a value the task
    sets in code is not overridden by a default from the file.
    """
    lines = [_comment(header), ""] if header else []
    for plugin, opts in _groups(options).items():
        lines.append(f"# ---- {plugin}")
        for opt in opts:
            value = values.get(opt.name, opt.default)
            source = sources.get(opt.name, "default")
            literal = toml_value(value)
            if literal is None:
                lines.append(f"# {opt.name} =   # {source} (unset)")
            elif source == "default":
                lines.append(f"# {opt.name} = {literal}  # default")
            else:
                lines.append(f"{opt.name} = {literal}  # {source}")
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def _pm() -> Any:
    from distrun.registry.manager import get_plugin_manager

    return get_plugin_manager()


def _resolve(pm: Any, config_file: str | None, flags: Mapping[str, Any]) -> Any:
    """The config as ``distrun run`` resolves it in the launcher, minus the run target."""
    from distrun.config.run_config import resolve_config
    from distrun.registry.collect import apply_cluster_env, collect_options

    config = resolve_config(collect_options(pm), flags=flags, config_file=config_file)
    config = apply_cluster_env(pm, config, dict(os.environ))
    return config


def _config_group(pm: Any) -> click.Group:
    from distrun.cli.main import _option_to_click
    from distrun.registry.collect import collect_options

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
        from distrun.spec.errors import UsageError

        text = template_toml(options)
        if output == "-":
            click.echo(text, nl=False)
            return
        if os.path.exists(output) and not force:
            raise UsageError(f"{output} exists (pass --force to overwrite it, or -o OTHER.toml)")
        with open(output, "w") as fh:
            fh.write(text)
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
def distrun_add_commands(cli):
    cli.add_command(_config_group(_pm()))
