"""Entry point of distrun-join: uneven inputs across ranks never hang (torch-free at import)."""

from __future__ import annotations

from distrun.plugin import hookimpl
from distrun_join.options import JoinOptions

DISTRUN_PLUGIN_API = 1  # the distrun.plugin API this plugin is written for


@hookimpl
def distrun_register_options(register):
    register(JoinOptions)


@hookimpl(wrapper=True)
def distrun_run_epoch(run, epoch):
    from distrun_join.uneven import uneven_epoch

    with uneven_epoch(run, epoch):
        return (yield)
