"""Entry point of distrun-tune: ``distrun tune lr|batch-size`` and ``--tune`` (torch-free).

``distrun tune lr [run options] TARGET`` is ``distrun run --tune lr [run options] TARGET``:
the same launch, strategy and world size as the run it tunes. In the workers the plugin
answers ``distrun_run_fit`` first, runs the finder instead of the fit, puts the model and
optimizer back as they were, writes the curve (PNG) and the numbers (JSON) into the run
folder, and says its suggestion on rank 0.
"""

from __future__ import annotations

from typing import Any

import click

from distrun.plugin import UsageError, hookimpl
from distrun_tune.options import FINDERS, TuneOptions

DISTRUN_PLUGIN_API = 1  # the distrun.plugin API this plugin is written for



@hookimpl
def distrun_register_options(register):
    register(TuneOptions)


@hookimpl
def distrun_configure(config):
    opts = TuneOptions.of(config)
    if opts.tune == "off":
        return
    if opts.tune_min_lr <= 0 or opts.tune_max_lr <= opts.tune_min_lr:
        raise UsageError(f"--tune-min-lr {opts.tune_min_lr:g} and --tune-max-lr "
                         f"{opts.tune_max_lr:g}: the range needs 0 < min < max")
    if opts.tune_max_memory:
        from distrun_tune.memory import parse_bytes

        parse_bytes(opts.tune_max_memory)  # one line now, not in every worker


def _forward(cli: click.Group, finder: str) -> click.Command:
    """``distrun tune FINDER ARGS`` = ``distrun run --tune FINDER ARGS``."""
    helps = {"lr": "LR range test: train with the learning rate rising exponentially from "
                   "--tune-min-lr to --tune-max-lr, plot the loss and suggest a rate.",
             "batch-size": "Largest per-rank batch whose training steps fit under "
                           "--tune-max-memory (doubling, then binary search)."}

    @click.command(finder, context_settings={"ignore_unknown_options": True,
                                             "allow_extra_args": True,
                                             "help_option_names": []},
                   help=helps[finder] + " Takes `distrun run`'s options and TARGET; "
                   "the model and optimizer are left as they were.", add_help_option=False)
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def command(args: tuple[str, ...]) -> None:
        run_cmd = cli.commands["run"]
        if "-h" in args or "--help" in args:
            click.echo(command.help)
            click.echo(f"\nUsage: distrun tune {finder} [distrun run options] TARGET")
            return
        run_cmd.main(args=["--tune", finder, *args], prog_name=f"distrun tune {finder}",
                     standalone_mode=False)

    return command


@hookimpl
def distrun_add_commands(cli):
    @cli.group("tune")
    def tune() -> None:
        """Finders on the run's own strategy and world size: `lr`, `batch-size`."""

    for finder in FINDERS[1:]:
        tune.add_command(_forward(cli, finder))


@hookimpl(tryfirst=True)
def distrun_run_fit(run: Any) -> Any:
    finder = TuneOptions.of(run.config).tune
    if finder == "off":
        return None  # the fit as usual
    if getattr(run.task, "automatic_optimization", True) is False:
        count = len(getattr(run.optimizer, "optimizers", None) or [run.optimizer])
        several = f" with {count} optimizers" if count > 1 else ""
        raise UsageError(
            f"--tune {finder}: the finder takes the fit's steps (one optimizer, stepped by the "
            f"loop), but {type(run.task).__name__} steps its optimizers itself "
            f"(automatic_optimization = False{several}); tune a version of the task with "
            "automatic optimization and one optimizer, or drop --tune")
    from distrun_tune.finders import run_finder

    return run_finder(run, finder)
