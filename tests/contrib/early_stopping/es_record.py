"""A test plugin (``DISTRUN_PLUGINS=es_record``): each rank writes where its fit ended."""

from __future__ import annotations

import json
import os

from distrun.plugin import hookimpl


@hookimpl
def distrun_on_fit_end(run):
    from distrun_early_stopping.plugin import EARLY_STOPPING

    rule = run.stash.get(EARLY_STOPPING)
    out = {"step": run.progress.step, "epoch": run.progress.epoch,
           "stopped_at": rule.stopped_at if rule else None,
           "wait": rule.wait if rule else None, "best_step": rule.best_step if rule else None}
    with open(os.path.join(run.run_dir, f"end-rank{run.rank}.json"), "w") as fh:
        json.dump(out, fh)
