"""Test-only plugin for the GAN example's resume test: ``GAN_STOP_AT=N`` makes rank 0 send
itself SIGTERM after step N, as a scheduler's preemption would (the ranks agree on a step,
save a ``preempt`` checkpoint and exit 143). Loaded with ``DISTRUN_PLUGINS=gan_stop_plugin``."""

from __future__ import annotations

import os
import signal

from distrun.plugin import hookimpl

DISTRUN_PLUGIN_API = 1


@hookimpl
def distrun_on_step_end(run, step):
    at = os.environ.get("GAN_STOP_AT")
    if at and step == int(at) and run.rank == 0:
        os.kill(os.getpid(), signal.SIGTERM)
