"""Entry point of distrun-ft (imports neither torch nor torchft): options, checks and hooks.

``distrun run --ft --replica-groups N --nproc-per-node K`` runs N replica groups of K ranks;
inside a group the run's strategy (ddp or fsdp) syncs the K ranks, and torchft's Manager syncs
the groups at every step. The launcher (:mod:`distrun_ft.launcher`) restarts a dead group on its
own; the workers' loop (:mod:`distrun_ft.loop`) keeps the survivors training meanwhile.
"""

from __future__ import annotations

from distrun.plugin import hookimpl
from distrun_ft.options import FtOptions

DISTRUN_PLUGIN_API = 1  # the distrun.plugin API this plugin is written for

PLUGIN = "ft"


@hookimpl
def distrun_register_options(register):
    register(FtOptions)


@hookimpl(wrapper=True, specname="distrun_launch")
def refuse_combinations(config, command, environ):
    # A wrapper, so a refused combination is refused before any launcher (elastic's included)
    # answers.
    if FtOptions.of(config).ft:
        from distrun_ft.settings import check_launch

        check_launch(config)
    return (yield)


@hookimpl(tryfirst=True)
def distrun_launch(config, command, environ):
    if not FtOptions.of(config).ft:
        return None
    from distrun_ft.launcher import launch_ft

    return launch_ft(config, command, environ)


@hookimpl(tryfirst=True)
def distrun_run_fit(run):
    if not FtOptions.of(run.config).ft:
        return None
    from distrun_ft.loop import fit_ft

    return fit_ft(run)


@hookimpl(tryfirst=True)
def distrun_save_checkpoint(run, reason):
    # Only the lowest live replica group writes the durable checkpoints: the others answer
    # first with an empty path (their weights are the same, bit for bit).
    if not FtOptions.of(run.config).ft:
        return None
    from distrun_ft.loop import is_saver

    return None if is_saver(run) else ""
