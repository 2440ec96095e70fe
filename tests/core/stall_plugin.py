"""A plugin whose checkpoint state hangs on one rank (``STALL_IN=checkpoint``, see
:mod:`stall_task`): it is read while a checkpoint is saved."""

from __future__ import annotations

from stall_task import hang_here

from distrun.plugin import hookimpl


@hookimpl
def distrun_state_dict(run):
    hang_here("checkpoint")
    return {}
