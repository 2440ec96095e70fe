"""The ``distrun`` command. Torch-free: ``distrun --help`` and ``distrun plugins`` stay fast."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from collections.abc import Sequence
from typing import Any

import click

from distrun._cli.run_args import RunCommand, is_task_target
from distrun._cli.run_checks import check_degrees, check_layout, check_stages, check_syntax
from distrun._config.run_config import CONFIG_ENV, RunConfig, resolve_config, with_values
from distrun._config.run_dir import fresh_run_folder
from distrun._launch.folder_lock import RUN_KEY_ENV, new_run_key
from distrun._registry.catalogue import offered
from distrun._registry.collect import (
    apply_cluster_env,
    check_consumed,
    choose_backends,
    choose_strategy,
    collect_backends,
    collect_options,
    collect_strategies,
    detect_cluster,
)
from distrun._registry.manager import (
    BLOCK_ENV,
    EXTRA_ENV,
    known_plugin_names,
    make_plugin_manager,
    plugin_infos,
)
from distrun._spec.cluster import ClusterEnv
from distrun._spec.errors import DistrunError, UsageError, closest
from distrun._version import __version__

__all__ = ["main", "build_cli"]



def _scan_plugin_flags(argv: Sequence[str]) -> tuple[list[str], list[str], bool]:
    """Read ``-p NAME`` / ``-p no:NAME`` and ``--debug`` before click builds the commands.

    Scanning stops at the run target (a ``.py`` path, ``x:Task`` or the module after ``-m``),
    so the script's own arguments are never taken for distrun's.
    """
    blocked: list[str] = []
    extra: list[str] = []
    debug = False
    i = 0
    while i < len(argv):
        arg, value = argv[i], None
        if arg == "-p" and i + 1 < len(argv):
            value, i = argv[i + 1], i + 1
        elif arg.startswith("-p") and not arg.startswith("--") and len(arg) > 2:
            value = arg[2:].lstrip("=")
        elif arg == "--debug":
            debug = True
        elif arg in ("-m", "--module") or not arg.startswith("-") and (arg.endswith(".py") or ":" in arg):
            break
        if value:
            (blocked if value.startswith("no:") else extra).append(value.removeprefix("no:"))
        i += 1
    return blocked, extra, debug


def _option_to_click(opt: Any) -> click.Option:
    names = [opt.flag, *opt.aliases]
    if opt.type is bool:
        return click.Option([f"{opt.flag}/--no-{opt.flag[2:]}", *opt.aliases], default=None,
                            help=opt.help, hidden=opt.hidden)
    help_text = opt.help
    if opt.default not in (None, ""):
        help_text += f"  [default: {opt.default}]"
    if opt.choices:
        help_text += f"  [choices: {', '.join(map(str, opt.choices))}]"
    return click.Option(names, default=None, help=help_text, hidden=opt.hidden,
                        metavar=opt.metavar or {int: "INT", float: "FLOAT"}.get(opt.type, "TEXT"))


def build_cli(pm: Any, blocked: Sequence[str] = (), extra: Sequence[str] = ()) -> click.Group:
    """The ``distrun`` command of ``pm``'s plugins; ``blocked`` and ``extra`` are the ``-p``
    flags ``main`` read, handed on to the workers of a launch."""
    @click.group(context_settings={"help_option_names": ["-h", "--help"]})
    @click.version_option(__version__, "--version", prog_name="distrun")
    @click.option("-p", "plugin_flags", multiple=True, metavar="NAME",
                  help="load plugin module NAME, or block one with -p no:NAME")
    @click.option("--debug", is_flag=True, help="show tracebacks for errors")
    def cli(plugin_flags: tuple[str, ...], debug: bool) -> None:
        """distrun: PyTorch distributed training with plugins.

        Start with `distrun run --nproc-per-node 2 train.py`.
        """

    options = collect_options(pm)

    @click.command(
        "run", cls=RunCommand,
        context_settings={"ignore_unknown_options": False, "allow_interspersed_args": False},
        help="Launch TARGET on this node's workers. TARGET is a script (a torchrun script runs "
             "unchanged), -m MODULE, or pkg.module:Task / file.py:Task.",
    )
    @click.option("-m", "--module", "as_module", is_flag=True,
                  help="TARGET is a module name, as `python -m`")
    @click.option("--config", "config_file", type=click.Path(), default=None,
                  help="TOML file of run options")
    @click.option("-p", "plugin_flags", multiple=True, metavar="NAME", hidden=True)
    @click.argument("target")
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def run_cmd(as_module: bool, config_file: str | None, plugin_flags: tuple[str, ...],
                target: str, args: tuple[str, ...], **flags: Any) -> None:
        flags = {k: v for k, v in flags.items() if v is not None}
        code = launch(pm, options, target, list(args), as_module, config_file, flags,
                      blocked=blocked, extra=extra)
        sys.exit(code)

    for opt in options:
        click_opt = _option_to_click(opt)
        click_opt.name = opt.name
        run_cmd.params.append(click_opt)
    run_cmd.launcher_only = frozenset(
        name for opt in options if opt.launcher_only for name in (opt.flag, *opt.aliases)
        if name.startswith("--"))
    cli.add_command(run_cmd)

    @cli.command("plugins")
    @click.option("--json", "as_json", is_flag=True, help="machine-readable output")
    def plugins_cmd(as_json: bool) -> None:
        """List installed plugins, their versions and the hooks they implement."""
        infos = plugin_infos(pm)
        if as_json:
            click.echo(json.dumps([i.__dict__ for i in infos], indent=2, default=list))
            return
        for info in infos:
            origin = "built-in" if info.builtin else info.distribution
            click.echo(f"{info.name} {info.version} ({origin})")
            for hook in info.hooks:
                click.echo(f"    {hook}")

    @cli.command("strategies")
    def strategies_cmd() -> None:
        """List the strategies installed plugins offer."""
        for name, info in sorted(collect_strategies(pm).items()):
            click.echo(f"{name:<10} {info.help}  [{info.plugin}]")

    @cli.command("env")
    def env_cmd() -> None:
        """Print versions, backends, devices, plugins and cluster: paste it into a bug report."""
        from distrun._cli.env_cmd import env_report

        click.echo(env_report(pm))

    pm.hook.distrun_add_commands(cli=cli, pluginmanager=pm)
    return cli


def _worker_command(target: str, args: list[str], as_module: bool) -> list[str]:
    # Every target runs inside the worker entry point: it dies with the launcher and tears
    # down a process group the target left behind before Python finalizes.
    py = [sys.executable, "-u", "-m", "distrun._worker.main"]
    if as_module:
        return [*py, "--module", target, *args]
    if target.endswith(".py"):
        if not os.path.isfile(target):
            raise UsageError(f"script not found: {target} (check the path)")
        return [*py, "--script", target, *args]
    if ":" in target:
        path = target.rpartition(":")[0]
        if path.endswith(".py") and not os.path.isfile(path):
            raise UsageError(f"task file not found: {path} (check the path before ':')")
        return [*py, target, *args]
    if os.path.isfile(target):
        return [*py, "--script", target, *args]
    raise UsageError(
        f"target not found: {target} (give a script path, -m MODULE, or pkg.module:Task)"
    )


def _default_name(target: str) -> str:
    base = target.rpartition(":")[2] if ":" in target else target
    stem = os.path.splitext(os.path.basename(base))[0] or "run"
    # the run folder's name: a control character in the script's file name is not carried
    stem = re.sub(r"[\x00-\x1f\x7f-\x9f]+", "-", stem)
    return f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def launcher_config(pm: Any, options: Any, target: str, config_file: str | None,
                    flags: dict[str, Any], as_module: bool = False,
                    cluster: ClusterEnv | None = None) -> RunConfig:
    """Resolve the config in the launcher: sources, cluster facts (``cluster``, detected once
    by the caller), strategy and run folder."""
    config = resolve_config(options, flags=flags, config_file=config_file, pluginmanager=pm)
    config = apply_cluster_env(config, cluster)
    from distrun._launch.binding import addresses_of
    from distrun._launch.local import resolve_nproc

    if config.local_addr:
        addresses_of(config.local_addr, "--local-addr")  # one line when this host has not it

    if config.standalone and config.nnodes not in ("1", "1:1"):
        raise UsageError(f"--standalone runs on one node but --nnodes is {config.nnodes} "
                         "(drop one of them)")
    nnodes = int(config.nnodes.partition(":")[2] or config.nnodes) \
        if config.nnodes.replace(":", "").isdigit() else None
    choose_backends(config, collect_backends(pm), nnodes)
    check_degrees(config)
    # "auto" is resolved in the worker for a script: a plain torchrun script never asks for a
    # strategy. A Task's config is final here (no code can change it): check what can be.
    task = is_task_target(target, as_module)
    if config.strategy != "auto" or task:
        world = None
        if config.nnodes.isdigit():
            world = resolve_nproc(config.nproc_per_node) * int(config.nnodes)
        info = choose_strategy(config, world, collect_strategies(pm), pm.is_blocked)
        if world is not None and world > 1 and not info.multi_process:
            raise UsageError(
                f"strategy '{info.name}' runs in one process but {world} were asked for "
                f"(use --nproc-per-node 1, or a multi-process strategy such as ddp)"
            )
        if task and world is not None:
            check_layout(config, info, world)
        if task:
            check_stages(config, target)
    if is_task_target(target, as_module):  # a script may still register plugins in code
        check_consumed(pm, options, config)
    # Fill only what the user left out, so flags keep "flag" as their recorded source. A plain
    # script gets a name (its workers agree on it) but a run folder only when one was asked
    # for; a Task target always has one. A script that calls distrun.fit() makes its own.
    fill = {}
    if not config.name:
        fill["name"] = _default_name(target)
    asked = any(k in config.sources and getattr(config, k) for k in ("name", "run_dir"))
    if not config.run_dir and (asked or is_task_target(target, as_module)):
        fill["run_dir"] = os.path.join("runs", config.name or fill["name"])
    config = with_values(config, **fill) if fill else config
    # One launcher decides alone only on one node: launchers of several nodes (or one per rank,
    # under srun or torchrun) would each see the others' folder and choose differently.
    if config.nnodes in ("1", "1:1") and not getattr(cluster, "per_process", False):
        config = fresh_run_folder(config, say=True)
    return config


def _command(config: RunConfig, target: str, args: list[str], as_module: bool) -> list[str]:
    """The workers' command line: torchrun's --no-python and --run-path included."""
    if config.no_python:
        if as_module or config.run_path:
            raise UsageError("--no-python runs TARGET as an executable: it cannot go with "
                             f"{'-m/--module' if as_module else '--run-path'} (as under torchrun)")
        if is_task_target(target):
            raise UsageError(f"--no-python runs an executable, but {target} is a Task (drop "
                             "--no-python)")
        exe = target if os.sep in target else shutil.which(target) or target
        if not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
            raise UsageError(f"--no-python: {target} is not an executable file (check the path "
                             "and its x bit, or drop --no-python for a Python script)")
        return [target, *args]
    if config.run_path and as_module:
        raise UsageError("--run-path runs a script file: it cannot go with -m/--module "
                         "(as under torchrun)")
    command = _worker_command(target, args, as_module)
    script = target.rpartition(":")[0] if is_task_target(target, as_module) else target
    if not as_module and os.path.isfile(script):
        check_syntax(script)
    return command


def launch(pm: Any, options: Any, target: str, args: list[str], as_module: bool,
           config_file: str | None, flags: dict[str, Any], blocked: Sequence[str] = (),
           extra: Sequence[str] = ()) -> int:
    cluster = detect_cluster(pm, os.environ)  # once per launch: the launchers get the answer
    config = launcher_config(pm, options, target, config_file, flags, as_module, cluster)
    command = _command(config, target, args, as_module)
    environ = dict(os.environ)
    environ[CONFIG_ENV] = config.to_json()
    # every process of this run, restarts included; on several nodes, the same on each node
    environ[RUN_KEY_ENV] = new_run_key() if config.nnodes in ("1", "1:1") else \
        new_run_key(config.name, config.master_addr, config.master_port)
    if blocked:
        environ[BLOCK_ENV] = ",".join(blocked)
    if extra:
        environ[EXTRA_ENV] = ",".join(extra)
    code = pm.hook.distrun_launch(config=config, command=command, environ=environ,
                                  cluster=cluster)
    return int(code or 0)


def _plugin_hint(exc: click.UsageError) -> str:
    """For an unknown flag a first-party plugin would add: the pip command that adds it."""
    if isinstance(exc, click.NoSuchOption):
        dist = offered("flags").get(exc.option_name.split("=", 1)[0])
        if dist:
            return f" ({exc.option_name} comes with {dist}: pip install {dist})"
    return ""


def _warn_unknown_blocked(pm: Any, blocked: list[str], extra: list[str]) -> None:
    """``-p no:NAME`` (or ``DISTRUN_BLOCK_PLUGINS``) naming no plugin is a typo: said, not fatal
    (as pytest does), with the closest name."""
    from_env = [n.strip() for n in os.environ.get(BLOCK_ENV, "").split(",") if n.strip()]
    known = known_plugin_names(pm) | set(extra)
    for name in dict.fromkeys([*blocked, *from_env]):
        if name in known:
            continue
        where = f"-p no:{name}" if name in blocked else f"{BLOCK_ENV}={name}"
        close = closest(name, known)
        hint = f"did you mean '{close}'? " if close else ""
        sys.stderr.write(
            f"warning: {where} blocks nothing: no installed plugin is named '{name}' ({hint}"
            "`distrun plugins` lists the names)\n"
        )


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    blocked, extra, debug = _scan_plugin_flags(argv)
    try:
        pm = make_plugin_manager(blocked=blocked, extra=extra)
        _warn_unknown_blocked(pm, blocked, extra)
        cli = build_cli(pm, blocked, extra)
        cli.main(args=argv, prog_name="distrun", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        sys.stderr.write("Aborted.\n")
        sys.exit(130)
    except click.UsageError as exc:
        message = exc.format_message().replace("\n", " ")
        where = exc.ctx.command_path if exc.ctx is not None else "distrun run"
        sys.stderr.write(f"error: {message}{_plugin_hint(exc)} (see `{where} --help`)\n")
        sys.exit(2)
    except DistrunError as exc:
        if debug:
            raise
        sys.stderr.write(f"error: {exc}\n")
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
