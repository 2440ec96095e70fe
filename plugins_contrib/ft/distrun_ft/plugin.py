"""Entry point of distrun-ft (imports neither torch nor torchft): options, checks and hooks.

``distrun run --ft --replica-groups N --nproc-per-node K`` runs N replica groups of K ranks;
inside a group the run's strategy (ddp) syncs the K ranks, and torchft's Manager syncs the
groups at every step. The launcher (:mod:`distrun_ft.launcher`) restarts a dead group on its
own; the workers' loop (:mod:`distrun_ft.loop`) keeps the survivors training meanwhile.
"""

from __future__ import annotations

from distrun.plugin import hookimpl, plugin_options

DISTRUN_PLUGIN_API = 1  # the distrun.plugin API this plugin is written for

PLUGIN = "ft"


@hookimpl
def distrun_register_options(register):
    opt = plugin_options(register, PLUGIN)
    opt("ft", bool, False, "fault tolerance without a restart (torchft): replica groups keep "
        "training when one dies; the launcher restarts it and it heals from a live peer")
    opt("replica_groups", int, 2, "replica groups this launcher starts under --ft, each of "
        "--nproc-per-node ranks", min=1)
    opt("ft_lighthouse", str, "", "a running torchft lighthouse, http://HOST:PORT (default: "
        "the launcher starts one on the run's address)", metavar="URL")
    opt("ft_max_restarts", int, 3, "restarts of each replica group after it dies (its own "
        "budget; --max-restarts is the elastic plugin's whole-job restart)", min=0)
    opt("ft_heartbeat", float, 2.0, "seconds without a heartbeat before a replica group is "
        "dropped from the quorum: the survivors' stall after a group dies is at most this "
        "plus one second", min=0.2, metavar="SECONDS")
    opt("ft_min_replicas", int, 1, "replica groups a step needs to commit", min=1)


@hookimpl(wrapper=True, specname="distrun_launch")
def refuse_combinations(config, command, environ):
    # A wrapper, so a refused combination is refused before any launcher (elastic's included)
    # answers.
    if config.get("ft", False):
        from distrun_ft.settings import check_launch

        check_launch(config)
    return (yield)


@hookimpl(tryfirst=True)
def distrun_launch(config, command, environ):
    if not config.get("ft", False):
        return None
    from distrun_ft.launcher import launch_ft

    return launch_ft(config, command, environ)


@hookimpl(tryfirst=True)
def distrun_run_fit(run):
    if not run.config.get("ft", False):
        return None
    from distrun_ft.loop import fit_ft

    return fit_ft(run)


@hookimpl(tryfirst=True)
def distrun_save_checkpoint(run, reason):
    # Only the lowest live replica group writes the durable checkpoints: the others answer
    # first with an empty path (their weights are the same, bit for bit).
    if not run.config.get("ft", False):
        return None
    from distrun_ft.loop import is_saver

    return None if is_saver(run) else ""
