"""The run config: one frozen, validated dataclass built from flags, env, a TOML file and code.

Precedence, highest first: command-line flag > ``DISTRUN_*`` environment variable > TOML file
(``--config``) > keyword arguments given in code (``Trainer(max_epochs=3)``) > default.
Core fields are declared here once; their CLI flags are derived from them. Plugin options live
in ``plugin_options`` and read typed through the plugin's own class
(``DdpOptions.of(config).ddp_bucket_mb``, :class:`~distrun._spec.options.PluginOptions`).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any, TypeVar

from distrun._config.option_values import (
    DEFAULT_SIGNALS,
    _backend,
    _nproc,
    _ranks_filter,
    _run_name,
    _signals,
    _stages,
    _std,
)
from distrun._spec.errors import UsageError, suggest
from distrun._spec.node import NodeService
from distrun._spec.options import Option, PluginOptions, coerce

_T = TypeVar("_T", bound=PluginOptions)

__all__ = ["RunConfig", "core_options", "resolve_config", "with_values", "CONFIG_ENV"]

#: the launcher hands the resolved explicit values to workers in this variable (JSON)
CONFIG_ENV = "DISTRUN_CONFIG"


def _opt(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class RunConfig:
    """Everything that shapes a run. Build it with :func:`resolve_config`; it is immutable."""

    # --- what to train and how -----------------------------------------------------------
    strategy: str = _opt("auto", "parallel strategy ('auto': single for 1 process, else the "
                                 "installed strategy that offers itself for auto)",
                         launcher_only=True)
    seed: int = _opt(0, "seed of model init, data order and RNG", min=0)
    max_epochs: int = _opt(1, "epochs to train", min=1)
    max_steps: int = _opt(-1, "stop after this many optimizer steps (-1: no limit)", min=-1)
    batch_size: int = _opt(32, "GLOBAL batch per micro-step, split evenly across data ranks", min=1)
    grad_accum: int = _opt(1, "micro-batches per optimizer step", min=1)
    grad_clip: float = _opt(0.0, "clip the gradient norm to this value (0: off)", min=0)
    val_every_n_steps: int = _opt(0, "validate every N steps (0: at each epoch end)", min=0)
    log_every_n_steps: int = _opt(10, "reduce and log metrics every N steps", min=1)
    drop_last: bool = _opt(True, "skip the tail of an epoch that does not fill a global batch "
                                 "(--no-drop-last: train it, filled up with the epoch's first "
                                 "samples)")
    limit_train_batches: int = _opt(0, "train on the first N micro-batches of each epoch "
                                       "(0: all)", min=0)
    limit_val_batches: int = _opt(0, "validate on the first N batches of each rank (0: all)",
                                  min=0)
    overfit_batches: int = _opt(0, "train and validate on the same N first batches, "
                                   "unshuffled, every epoch (0: off)", min=0)
    fast_dev_run: int = _opt(0, "a smoke test: N training and N validation batches, one "
                                "epoch, no sanity pass, no checkpoints (0: off)", min=0)
    num_sanity_val_steps: int = _opt(2, "validation batches run before training to catch a "
                                        "broken validation_step early (0: off)", min=0)
    activation_checkpointing: str = _opt(
        "", "recompute the activations of the submodules of these classes in the backward "
            "pass, e.g. TransformerEncoderLayer (less memory, one more forward each)",
        metavar="CLASS[,CLASS]")
    deterministic: bool = _opt(False, "torch's deterministic algorithms (slower on CUDA; an "
                                      "op without a deterministic version raises)")
    num_workers: int = _opt(0, "DataLoader worker processes per rank", min=0)
    device: str = _opt("auto", "device type", choices=("auto", "cpu", "cuda"))
    backend: str = _opt("auto", "communication backend: a name (gloo, nccl, mpi, or one a "
                                "plugin offers: `distrun env` lists them) or a device map "
                                "(cpu:gloo,cuda:nccl); 'auto': nccl on CUDA, gloo on CPU",
                        parse=_backend, metavar="NAME|DEVICE:NAME,...", launcher_only=True)
    nonfinite_loss: str = _opt("warn", "a NaN/inf loss: warn once and go on, stop the run at that "
                                      "step, or ignore it", choices=("warn", "stop", "ignore"))
    timeout: float = _opt(300.0, "seconds a collective may wait before failing", min=1)
    stall_timeout: float = _opt(
        -1.0, "seconds in which no rank moves before the launcher names the rank the others "
              "wait for, with every rank's stacks (-1: max(60, 20 steps), under --timeout; "
              "0: off)", min=-1, launcher_only=True)
    on_stall: str = _opt("stop", "after naming a stall: end the run (exit 1; --max-restarts "
                                 "restarts it) or wait for --timeout", choices=("stop", "wait"),
                         launcher_only=True)
    resume: str = _opt("never", "'never', 'auto' (the run's newest valid checkpoint, if any), "
                               "'latest' (the same, but one must exist), a word a checkpoint "
                               "plugin adds, or a PATH",
                       consumer="distrun_load_checkpoint")
    name: str = _opt("", "run name (default: the script's name and the start time)",
                     parse=_run_name)
    run_dir: str = _opt("", "run folder (default: runs/NAME; a plain torchrun script gets one "
                            "only when asked: --name or --run-dir)", exclusive=True)
    stage: str = _opt("fit", "what to run: fit, validate, test or predict, or several in order "
                             "(fit,test); an evaluation alone loads --resume's checkpoint",
                      parse=_stages, metavar="STAGE[,STAGE]")
    compile: bool = _opt(False, "torch.compile the model (after the strategy's wrapping; "
                                "checkpoint keys stay the module's)")
    predictions: str = _opt("return", "predict: gather the outputs in dataset order on every "
                                      "rank, or write each rank's to RUN_DIR/predictions",
                            choices=("return", "write"))
    summary: bool = _opt(True, "print the model summary table on rank 0")
    debug: bool = _opt(False, "show tracebacks for user errors")
    # --- launcher ------------------------------------------------------------------------
    nproc_per_node: Any = _opt(
        1, "worker processes on this node; cpu: one per CPU, gpu: one per GPU, auto: per GPU "
           "if there are any, else per CPU", parse=_nproc,
        aliases=("--nproc_per_node",), metavar="N|cpu|gpu|auto", type=str, launcher_only=True,
    )
    nnodes: str = _opt("1", "nodes (N, or MIN:MAX with the elastic plugin)", launcher_only=True)
    node_rank: int = _opt(0, "rank of this node", min=0, aliases=("--node_rank",),
                          launcher_only=True)
    master_addr: str = _opt("127.0.0.1", "address of rank 0's node",
                            aliases=("--master_addr",), launcher_only=True)
    master_port: int = _opt(0, "port of rank 0's store (0: a free port)", min=0, max=65535,
                            aliases=("--master_port",), launcher_only=True)
    local_addr: str = _opt("", "this node's address, the one the other nodes reach (default: "
                               "what this host's name resolves to); gloo uses its interface",
                           aliases=("--local_addr",), metavar="ADDRESS", launcher_only=True)
    tee: bool = _opt(False, "prefix each worker line with its rank (torchrun's --tee N, N>0, "
                            "means the same)", launcher_only=True)
    # --- torchrun's other launcher flags, with torchrun's meaning ----------------------------
    standalone: bool = _opt(False, "one node, rendezvous on 127.0.0.1 and a free port (what "
                                   "distrun does anyway on one node)", launcher_only=True)
    log_dir: str = _opt("", "write each rank's output to DIR/rank<N>.log and torch's error "
                            "files to DIR/rank<N>.error.json", aliases=("--log_dir",),
                        metavar="DIR")
    redirects: str = _opt("0", "torchrun's --redirects: streams (1 stdout, 2 stderr, 3 both, or "
                               "LOCAL_RANK:N,...) that go only to the log files, not the console",
                          parse=_std, aliases=("-r",), metavar="N", launcher_only=True)
    local_ranks_filter: str = _opt("", "show only these local ranks' output on the console "
                                       "(all of it still goes to the log files)",
                                   parse=_ranks_filter, aliases=("--local_ranks_filter",),
                                   metavar="R,...", launcher_only=True)
    role: str = _opt("default", "worker role, exported as ROLE_NAME")
    start_method: str = _opt("spawn", "how torchrun starts function entry points; scripts "
                                      "always start as new processes, as under torchrun",
                             choices=("spawn", "fork", "forkserver"),
                             aliases=("--start_method",), launcher_only=True)
    no_python: bool = _opt(False, "run TARGET as an executable, not a Python script",
                           aliases=("--no_python",), launcher_only=True)
    run_path: bool = _opt(False, "run TARGET with runpy.run_path (as torchrun --run-path)",
                          aliases=("--run_path",), launcher_only=True)
    signals_to_handle: str = _opt(DEFAULT_SIGNALS, "signals the workers are told to handle "
                                                   "(TORCHELASTIC_SIGNALS_TO_HANDLE)",
                                  parse=_signals, aliases=("--signals_to_handle",),
                                  metavar="SIG,...", launcher_only=True)
    # --- plugin options and provenance (not flags) ---------------------------------------
    plugin_options: Mapping[str, Any] = field(default_factory=dict, compare=False)
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    #: the plugin manager whose plugins declared the options (pytest's config.pluginmanager):
    #: it travels with the config instead of living in a process global. Not data: never
    #: serialized or compared, and None in a config built without plugins.
    pluginmanager: Any = field(default=None, compare=False, repr=False)
    #: typed plugin options already built (:meth:`options`), per class
    _typed: dict[type, Any] = field(default_factory=dict, init=False, compare=False, repr=False)

    def options(self, kind: type[_T]) -> _T:
        """The plugin options of class ``kind`` in this config (``kind.of(config)``): each
        field's value as resolved, or its default where the config has none (a config built
        without that plugin)."""
        got = self._typed.get(kind)
        if got is None:
            values = self.plugin_options
            got = self._typed[kind] = kind(**{
                f.name: values[f.name] for f in fields(kind)  # type: ignore[arg-type]
                if f.name in values})
        return got

    def get(self, name: str, default: Any = None) -> Any:
        """The core field or plugin option ``name``, or ``default`` when none is declared
        (plugins read theirs typed: :meth:`options`)."""
        if name in _CORE_NAMES:
            return getattr(self, name)
        return self.plugin_options.get(name, default)

    def with_values(self, source: str = "launcher", **values: Any) -> RunConfig:
        """A copy of this config with some fields (core or plugin options) set, recorded as
        coming from ``source``."""
        return with_values(self, source, **values)

    def node_services(self) -> list[NodeService]:
        """The services this config's plugins offer to run beside a node's ranks
        (``distrun_node_services``), for a launcher to give every worker group it starts;
        empty for a config built without plugins."""
        if self.pluginmanager is None:
            return []
        return [s for s in self.pluginmanager.hook.distrun_node_services(config=self)
                if s is not None]

    def parallel_degrees(self) -> dict[str, int]:
        """The parallel degrees this config's plugins ask for (``distrun_parallel_degrees``):
        ``{"tp": 2}``; empty for a config built without plugins."""
        if self.pluginmanager is None:
            return {}
        out: dict[str, int] = {}
        for answer in self.pluginmanager.hook.distrun_parallel_degrees(config=self):
            for name, degree in (answer or {}).items():
                if name in out:
                    raise UsageError(f"parallel degree {name!r} is published by two plugins "
                                     "(uninstall or block one of them)")
                out[name] = int(degree)
        return out

    @property
    def world_size_requested(self) -> int | None:
        """nproc_per_node x nnodes when both are fixed numbers, else None."""
        if isinstance(self.nproc_per_node, int) and self.nnodes.isdigit():
            return self.nproc_per_node * int(self.nnodes)
        return None

    def explicit(self) -> dict[str, Any]:
        """The values that did not come from the default (what workers must reproduce)."""
        out = {k: getattr(self, k) for k in self.sources if k in _CORE_NAMES}
        out.update({k: v for k, v in self.plugin_options.items() if k in self.sources})
        return out

    def to_json(self) -> str:
        return json.dumps({"values": self.explicit(), "sources": dict(self.sources)})

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name in _CORE_NAMES}
        out.update(self.plugin_options)
        return out

    def to_toml(self, options: list[Option] | None = None, header: str = "") -> str:
        """This config as TOML, each value with its source and defaults commented out, as the
        run folder's ``config.toml`` records it (for loggers that record the config).

        ``options``: the declarations to render it with (grouped by plugin, with help); by
        default the core's and the plugin options' names, no hook called again.
        """
        from distrun._config.toml_file import render_config

        if options is None:
            # a worker has the plugin options' values, not their declarations, and must not
            # re-run ``distrun_register_options``: they are listed under "plugins"
            core = core_options()
            names = {o.name for o in core}
            options = core + [Option(name=n, plugin="plugins") for n in self.plugin_options
                              if n not in names]
        return render_config(self, options, header, os.environ.get(CONFIG_ENV))


_CORE_NAMES = frozenset(f.name for f in fields(RunConfig) if "help" in f.metadata)


def core_options() -> list[Option]:
    """The core fields of :class:`RunConfig` as :class:`Option` declarations."""
    out = []
    for f in fields(RunConfig):
        if "help" not in f.metadata:
            continue
        meta = dict(f.metadata)
        typ = meta.pop("type", None) or {"int": int, "float": float, "bool": bool}.get(
            str(f.type), str
        )
        out.append(Option(name=f.name, type=typ, default=f.default, **meta))
    return out


def resolve_config(
    options: Iterable[Option],
    *,
    flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    config_file: str | None = None,
    code: Mapping[str, Any] | None = None,
    inherited: Mapping[str, Any] | None = None,
    inherited_sources: Mapping[str, str] | None = None,
    pluginmanager: Any = None,
) -> RunConfig:
    """Merge every source into a validated :class:`RunConfig`.

    ``flags`` are raw values the user typed (name -> str); ``inherited`` are values a launcher
    already resolved (from ``DISTRUN_CONFIG``), which rank like flags and keep the sources the
    launcher saw (``inherited_sources``). ``pluginmanager``: the manager whose plugins gave
    ``options``, kept on the config (``config.pluginmanager``).
    """
    opts = {o.name: o for o in options}
    environ = os.environ if environ is None else environ
    layers: list[tuple[str, Mapping[str, Any]]] = []
    if code:
        _reject_unknown(code, opts, "Trainer(...) arguments")
        layers.append(("code", code))
    if config_file:
        layers.append((config_file, _read_toml(config_file, opts)))
    env_values = {n: environ[o.env_var] for n, o in opts.items() if o.env_var in environ}
    if env_values:
        layers.append(("env", env_values))
    if inherited:
        layers.append(("launcher", {k: v for k, v in inherited.items() if k in opts}))
    if flags:
        _reject_unknown(flags, opts, "command-line flags")
        layers.append(("flag", flags))

    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for source, layer in layers:
        for name, raw in layer.items():
            if raw is None:
                continue
            opt = opts[name]
            label = opt.env_var if source == "env" else source
            if source == "launcher" and inherited_sources:
                label = inherited_sources.get(name, source)
            values[name] = coerce(opt, raw, label) if source != "launcher" else raw
            sources[name] = label
    core = {k: v for k, v in values.items() if k in _CORE_NAMES}
    plugin = {n: values.get(n, o.default) for n, o in opts.items() if n not in _CORE_NAMES}
    config = RunConfig(**core, plugin_options=MappingProxyType(plugin),
                       sources=MappingProxyType(sources), pluginmanager=pluginmanager)
    _check(config)
    return config


def _reject_unknown(given: Mapping[str, Any], opts: Mapping[str, Option], where: str) -> None:
    for key in given:
        if key not in opts:
            raise UsageError(
                f"unknown option '{key}' in {where}{suggest(key, opts)} "
                f"(see `distrun run --help` for the options installed plugins add)"
            )


def _read_toml(path: str, opts: Mapping[str, Option]) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - python 3.10
        import tomli as tomllib
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise UsageError(f"config file not found: {path} (check the --config path)") from None
    except IsADirectoryError:
        raise UsageError(f"--config {path} is a folder; give the TOML file itself (e.g. "
                         f"{os.path.join(path, 'config.toml')})") from None
    except OSError as exc:
        raise UsageError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"config file {path} is not valid TOML: {exc}") from None
    # A [distrun] table or top-level keys; plugin tables ([ddp]) flatten to ddp_<key>.
    if isinstance(data.get("distrun"), dict):
        data = {**{k: v for k, v in data.items() if k != "distrun"}, **data["distrun"]}
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            for sub, v in value.items():
                flat[f"{key}_{sub}"] = v
        else:
            flat[key] = value
    for key in flat:
        if key not in opts:
            raise UsageError(
                f"unknown key '{key}' in {path}{suggest(key, opts)} "
                "(remove it, or install the plugin that declares it)"
            )
    return flat


#: the core's ``--resume`` words; plugins add theirs (``distrun_resume_words``), anything
#: else is a path
RESUME_WORDS = ("never", "auto", "latest")


def resume_words(pluginmanager: Any) -> dict[str, str]:
    """The words ``--resume`` takes besides the core's: word -> what it loads, from the
    plugins of ``pluginmanager`` (``distrun_resume_words``); empty without one."""
    out: dict[str, str] = {}
    if pluginmanager is None:
        return out
    for answer in pluginmanager.hook.distrun_resume_words():
        for word, meaning in (answer or {}).items():
            if word in out or word in RESUME_WORDS:
                raise UsageError(f"--resume word {word!r} is named by two plugins (uninstall "
                                 "or block one of them)")
            out[word] = meaning
    return out


def _check(config: RunConfig) -> None:
    if config.sources.get("name") == "flag" and not config.name:
        # `--name "$RUN"` with RUN unset. In a file or a variable "" is the default (the
        # `config init` template writes `name = ""`), on the command line never a name.
        raise UsageError("--name is empty: give a run name, or leave --name out for the "
                         "default (the script's name and the start time)")
    words = (*RESUME_WORDS, *resume_words(config.pluginmanager))
    if config.resume not in words and not os.path.exists(config.resume):
        listed = ", ".join(f"'{w}'" for w in words if w != "never")
        raise UsageError(
            f"--resume {config.resume}: no such checkpoint "
            f"(use {listed}, 'never' or an existing path)"
        )
    if config.resume not in words and not os.path.isdir(config.resume):
        raise UsageError(
            f"--resume {config.resume} is a file; give a checkpoint folder (step-N), a "
            "checkpoints folder or a run folder"
        )
    if config.stall_timeout >= config.timeout:
        raise UsageError(f"--stall-timeout {config.stall_timeout:g} must be shorter than "
                         f"--timeout {config.timeout:g}: a collective would fail first, with no "
                         "diagnosis (lower --stall-timeout or raise --timeout)")
    nnodes = config.nnodes
    parts = nnodes.split(":")
    if not (1 <= len(parts) <= 2 and all(p.isdigit() and int(p) >= 1 for p in parts)):
        raise UsageError(f"invalid value for --nnodes: {nnodes!r} (use N or MIN:MAX, e.g. 2 or 1:2)")
    if len(parts) == 1 and config.node_rank >= int(nnodes):
        raise UsageError(
            f"--node-rank {config.node_rank} is out of range for --nnodes {nnodes} "
            f"(use 0..{int(nnodes) - 1})"
        )


def with_values(config: RunConfig, source: str = "launcher", **values: Any) -> RunConfig:
    """A copy of ``config`` with some fields set (recorded as coming from ``source``)."""
    core = {k: v for k, v in values.items() if k in _CORE_NAMES}
    plugin = dict(config.plugin_options)
    plugin.update({k: v for k, v in values.items() if k not in _CORE_NAMES})
    sources = {**config.sources, **{k: source for k in values}}
    return replace(config, **core, plugin_options=MappingProxyType(plugin),
                   sources=MappingProxyType(sources))


