"""The rendezvous generation: which round of an elastic run a worker belongs to (torch-free).

A launcher that re-forms the job (the elastic agent of distrun-elastic) numbers its rendezvous
rounds: the number grows with every round and is the same on every node of a round. It exports
it to every worker as :data:`GENERATION_ENV`, beside torchrun's variables; a worker reads it
once, as ``run.generation``. Launchers that never re-form (the core's local launcher, a plain
``torchrun``) leave it unset: generation 0.

A checkpoint plugin records it with each commit, so a node left behind in an older round (cut
off by a partition, frozen) can be told apart from the round that replaced it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from distrun._spec.errors import UsageError

__all__ = ["GENERATION_ENV", "read_generation"]

#: the worker environment variable holding the rendezvous generation (unset: 0)
GENERATION_ENV = "DISTRUN_RDZV_GENERATION"


def read_generation(environ: Mapping[str, str] | None = None) -> int:
    """The rendezvous generation in ``environ`` (``os.environ`` by default); 0 when unset."""
    value = (os.environ if environ is None else environ).get(GENERATION_ENV, "").strip()
    if not value:
        return 0
    try:
        generation = int(value)
    except ValueError:
        generation = -1
    if generation < 0:
        raise UsageError(f"{GENERATION_ENV}={value[:40]!r} is not a rendezvous generation (a "
                         "whole number >= 0, set by the elastic agent; unset it)")
    return generation
