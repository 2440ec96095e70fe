"""Run options: one declaration gives a CLI flag, a TOML key and a DISTRUN_* variable.

A plugin declares its options as one frozen dataclass (a :class:`PluginOptions` subclass whose
fields are the options, each made with :func:`option`): the same class registers them and
reads them back typed (``DdpOptions.of(config).ddp_bucket_mb``), so each default is written
once and the type checker sees every read.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar

from distrun._spec.errors import UsageError

__all__ = ["Option", "PluginOptions", "coerce", "option", "plugin_options"]

_T = TypeVar("_T", bound="PluginOptions")


@dataclass(frozen=True)
class Option:
    """One run option, declared by core or a plugin through ``distrun_register_options``.

    ``name`` is the config field (``ddp_bucket_mb``); the flag is ``--ddp-bucket-mb``, the TOML
    key ``ddp_bucket_mb`` and the environment variable ``DISTRUN_DDP_BUCKET_MB``.
    ``type`` is one of bool, int, float, str; ``choices`` limits the values; ``min`` bounds
    numbers from below and ``max`` from above; ``parse`` replaces the built-in conversion for special values.
    ``consumer`` names the hook that reads the option when the option's reader is another
    plugin than its declarer (``resume``: ``distrun_load_checkpoint``): a value the user set
    while no plugin implements that hook is an error, not a silent no-op.
    ``exclusive`` marks a folder option that one live run uses at a time (the run folder, a
    checkpoint folder): the core locks the folder for the run's life and refuses a second run
    (:mod:`distrun._launch.folder_lock`).
    ``launcher_only`` marks an option only a launcher reads (``--nproc-per-node``,
    ``--max-restarts``): no script has one of its own, so given after a script it is warned
    about (it goes to the script, and distrun never sees it).
    """

    name: str
    type: type = str
    default: Any = None
    help: str = ""
    choices: Sequence[str] | None = None
    min: float | None = None
    max: float | None = None
    aliases: Sequence[str] = ()
    parse: Callable[[str], Any] | None = None
    metavar: str | None = None
    plugin: str = "core"
    hidden: bool = field(default=False, compare=False)
    consumer: str = ""
    exclusive: bool = False
    launcher_only: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env_var(self) -> str:
        return "DISTRUN_" + self.name.upper()


def plugin_options(register: Callable[[Option], Any], plugin: str,
                   **common: Any) -> Callable[..., Option]:
    """``opt(name, type, default, help, **kw)``: declare one option of ``plugin`` and register it.

    For ``distrun_register_options(register)``: ``opt = plugin_options(register, "ddp")``.
    ``common`` applies to every option (``hidden=True``); ``kw`` of one call overrides it.
    The older form of :class:`PluginOptions`, kept for plugins written before it: options
    declared so read back with ``config.get(name)`` (the declared default when unset).
    """

    def opt(name: str, type: type = str, default: Any = None, help: str = "",
            **kw: Any) -> Option:
        option = Option(name=name, type=type, default=default, help=help, plugin=plugin,
                        **{**common, **kw})
        register(option)
        return option

    return opt


def option(default: Any, help: str = "", **kw: Any) -> Any:
    """One field of a :class:`PluginOptions` class: its default, help and :class:`Option`
    settings (``choices``, ``min``, ``max``, ``aliases``, ``parse``, ``metavar``, ``hidden``,
    ``consumer``, ``exclusive``, ``launcher_only``; ``type`` when the annotation is not one of
    bool, int, float, str or such a type ``| None``)."""
    return field(default=default, metadata={"help": help, **kw})


class _HasOptions(Protocol):
    def options(self, kind: type[_T]) -> _T: ...


_TYPES: dict[str, type] = {"bool": bool, "int": int, "float": float, "str": str}


class PluginOptions:
    """A plugin's options: subclass it as a frozen dataclass whose fields are the options.

    ::

        @dataclass(frozen=True)
        class DdpOptions(PluginOptions, plugin="ddp"):
            ddp_bucket_mb: float = option(25.0, "DDP gradient bucket size in MiB", min=0.001)

        @hookimpl
        def distrun_register_options(register):
            register(DdpOptions)

        opts = DdpOptions.of(run.config)  # typed, defaults from the class

    Class keywords: ``plugin`` names the declaring plugin (shown in ``--help``); any other
    (``launcher_only=True``, ``hidden=True``) applies to every field unless the field says
    otherwise. Field names are the option names, unique across plugins (prefix them).
    """

    #: the plugin that declares these options
    distrun_plugin: ClassVar[str] = ""
    distrun_common: ClassVar[dict[str, Any]] = {}

    def __init_subclass__(cls, plugin: str = "", **common: Any) -> None:
        super().__init_subclass__()
        cls.distrun_plugin = plugin or cls.__module__.partition(".")[0].removeprefix("distrun_")
        cls.distrun_common = common

    @classmethod
    def declarations(cls) -> list[Option]:
        """One :class:`Option` per field (what ``register(cls)`` declares)."""
        params = getattr(cls, "__dataclass_params__", None)
        if "__dataclass_fields__" not in cls.__dict__ or params is None or not params.frozen:
            raise TypeError(f"{cls.__qualname__} must be decorated with @dataclass(frozen=True) "
                            "to declare options")
        try:
            hints = typing.get_type_hints(cls)
        except (NameError, TypeError):  # an annotation only a type checker resolves
            hints = {}
        out = []
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            meta = {**cls.distrun_common, **f.metadata}
            typ = meta.pop("type", None) or _option_type(hints.get(f.name, f.type))
            if typ is None:
                raise TypeError(f"{cls.__qualname__}.{f.name}: annotate it as bool, int, float "
                                "or str (or such a type | None), or give option(..., type=...)")
            out.append(Option(name=f.name, type=typ, default=f.default,
                              plugin=cls.distrun_plugin, **meta))
        return out

    @classmethod
    def of(cls: type[_T], config: _HasOptions) -> _T:
        """These options' values in ``config`` (a :class:`~distrun.plugin.RunConfig`): what
        the user set, else the field's default. Cached per config."""
        return config.options(cls)


def _option_type(annotation: Any) -> type | None:
    if isinstance(annotation, str):
        return _TYPES.get(annotation.replace("| None", "").replace("None |", "").strip())
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = args[0] if len(args) == 1 else None
    return annotation if annotation in _TYPES.values() else None


#: C0 and C1 control characters and DEL: no option value needs one, and in a folder name, a
#: log line or a job script a newline or an escape forges lines or hides the rest
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def coerce(option: Option, value: Any, source: str) -> Any:
    """Convert ``value`` (a string from a flag/env or a TOML value) and validate it.

    ``source`` names where the value came from (``--flag``, ``DISTRUN_X``, ``run.toml``) so the
    error can point at it. Every option, core or plugin, passes here: a string holding a
    control character and a float that is not finite (nan, inf) are refused for all of them.
    """
    if value is None:
        return None
    where = f"{option.flag}" if source == "flag" else f"'{option.name}' in {source}"
    if isinstance(value, str) and _CONTROL.search(value):
        raise UsageError(f"invalid value for {where}: {value!r} holds a control character (a "
                         "newline, tab or escape); give it on one line in printable characters")
    try:
        if option.parse is not None and isinstance(value, (str, int, float)) \
                and not isinstance(value, bool):
            out = option.parse(str(value))  # a TOML number too: `nproc_per_node = 2`
        elif option.type is bool:
            out = _to_bool(value)
        elif option.type is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            out = int(value)
        elif option.type is float:
            if isinstance(value, bool):
                raise ValueError
            out = float(value)
        else:
            if not isinstance(value, str):
                raise ValueError
            out = value
    except (ValueError, TypeError, OverflowError) as exc:
        if option.parse is not None and str(exc):
            # the parser's own reason says what is allowed ("must be at least 1, ...")
            raise UsageError(f"invalid value for {where}: {value!r} {exc}") from None
        kind = {bool: "true or false", int: "a whole number", float: "a number"}.get(
            option.type, "a string"
        )
        detail = f" ({exc})" if str(exc) else ""
        raise UsageError(
            f"invalid value for {where}: {value!r} is not {kind}{detail}; "
            f"example: {option.flag} {option.default if option.default is not None else 1}"
        ) from None
    if isinstance(out, float) and not math.isfinite(out):
        # nan passes every comparison with min and max, inf every minimum: each float option
        # (its own parser's too) is checked here, so no derived timeout reads "nans"
        raise UsageError(
            f"invalid value for {where}: {value!r} is not a finite number; give a plain "
            f"number, e.g. {option.flag} {option.default if option.default is not None else 1}"
        )
    if option.choices is not None and out not in option.choices:
        from distrun._spec.errors import suggest

        raise UsageError(
            f"invalid value for {where}: {out!r}{suggest(str(out), option.choices)} "
            f"Allowed: {', '.join(map(str, option.choices))}"
        )
    if option.min is not None and isinstance(out, (int, float)) and out < option.min:
        raise UsageError(f"invalid value for {where}: {out} is below the minimum {option.min:g}")
    if option.max is not None and isinstance(out, (int, float)) and out > option.max:
        raise UsageError(f"invalid value for {where}: {out} is above the maximum {option.max:g}")
    return out


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError
