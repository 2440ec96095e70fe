"""Entry point of distrun-join: uneven inputs across ranks never hang (torch-free at import)."""

from __future__ import annotations

from distrun.plugin import hookimpl, plugin_options

DISTRUN_PLUGIN_API = 1  # the distrun.plugin API this plugin is written for

#: ``--join-mode`` values; see README.md for what each does with the surplus batches
MODES = ("auto", "join", "agree", "off")


@hookimpl
def distrun_register_options(register):
    opt = plugin_options(register, "join")
    opt("join_mode", str, "auto",
        "uneven inputs: 'join' wraps each epoch in torch's Join (DDP, ZeRO), 'agree' trains "
        "every rank for the smallest rank's batch count, 'auto' picks join when the model or "
        "optimizer is joinable and agree otherwise (only for per-rank iterables), 'off'",
        choices=MODES)
    opt("join_throw_on_early_termination", bool, False,
        "Join: when one rank runs out of batches, every rank stops with an error")
    opt("join_divide_by_initial_world_size", bool, True,
        "Join: average gradients over the initial world size even after ranks join "
        "(False: over the ranks still training)")


@hookimpl(wrapper=True)
def distrun_run_epoch(run, epoch):
    from distrun_join.uneven import uneven_epoch

    with uneven_epoch(run, epoch):
        return (yield)
