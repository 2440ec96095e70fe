"""TOML text of run options: the ``config init`` template and the run folder's ``config.toml``.

Reading is ``tomllib`` (``tomli`` before Python 3.11) in :mod:`distrun._config.run_config`;
this module only writes.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterable, Mapping
from typing import Any

from distrun._spec.options import Option

__all__ = ["render_config", "render_toml", "template_toml", "toml_value"]


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



def render_config(config: Any, options: list[Option], header: str = "",
                  launcher_record: str | None = None) -> str:
    """``config`` (a run config) as TOML with each value's source (:func:`render_toml`).

    ``launcher_record``: the launcher's JSON record of the config, in a worker; its sources
    beat the worker's "launcher" label.
    """
    sources = dict(config.sources)
    if launcher_record:
        try:
            launcher = json.loads(launcher_record).get("sources", {})
        except ValueError:
            launcher = {}
        for name, source in launcher.items():
            if sources.get(name) in (None, "launcher"):
                sources[name] = source
    return render_toml(options, config.as_dict(), sources, header=header)
