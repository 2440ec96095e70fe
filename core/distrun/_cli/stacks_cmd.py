"""``distrun stacks [RUN]``: where every rank of a live run is, and every thread's stack.

From another terminal on a node of the run: the command reads the position records of the
run's ranks on this host, asks each for its stacks (:mod:`distrun._diagnose.stacks`), prints
the one-line summary the stall watcher would print, and writes the evidence to
``RUN/stacks-N/`` (a run without a folder: the temporary folder). A multi-node run: the
ranks of this node ask the other nodes' ranks through the run's store
(:mod:`distrun._diagnose.exchange`), and the line names every node's ranks (or the nodes whose
report did not come in time).
"""

from __future__ import annotations

import os
import time
from typing import Any

import click

from distrun._spec.errors import UsageError
from distrun._spec.markers import hookimpl

__all__ = ["stacks_cmd"]


def _choose(run: str | None) -> tuple[str, dict[str, Any]]:
    from distrun._diagnose.watcher import live_runs

    live = live_runs()
    if run is not None:
        want = os.path.abspath(run)
        live = [(f, i) for f, i in live if want in (i.get("run_dir"), os.path.abspath(
            i.get("log_dir") or "//")) or run == i.get("name")]
    if not live:
        where = f"{run} is not a live run on this host" if run else \
            "no distrun run is live on this host"
        raise UsageError(f"{where} (run `distrun stacks` on a node of a running `distrun run`, "
                         "with its run folder, e.g. runs/NAME)")
    if len(live) > 1:
        names = ", ".join(i.get("run_dir") or i.get("name") or f for f, i in live)
        raise UsageError(f"{len(live)} runs are live on this host ({names}): name one, "
                         "`distrun stacks RUN`")
    return live[0]


@click.command("stacks")
@click.argument("run", required=False)
def stacks_cmd(run: str | None) -> None:
    """Print where each rank of a live RUN (its folder or name) is and write every thread's
    stack of each to RUN/stacks-N/ (without RUN: the one run live on this host)."""
    from distrun._diagnose.exchange import across_nodes
    from distrun._diagnose.summary import summarize, write_evidence
    from distrun._diagnose.watcher import evidence_folder, node_views

    folder, info = _choose(run)
    views = node_views(folder)
    if not views:
        raise UsageError("the run has no ranks running on this host yet (try again once they "
                         "started)")
    unseen = ""
    nnodes = int(info.get("nnodes") or 1)
    if nnodes > 1:
        views, unseen = across_nodes(folder, [v.rank for v in views], views, nnodes,
                                     int(info.get("node_rank") or 0),
                                     f"stacks-{os.getpid()}-{time.time_ns()}", ask=True)
    out = evidence_folder(str(info.get("run_dir") or info.get("log_dir") or ""), base="stacks")
    now = time.monotonic()
    line = summarize(views, now, evidence=out + os.sep, title="positions", unseen=unseen)
    write_evidence(out, views, line, now)
    click.echo(line)


@hookimpl
def distrun_add_commands(cli: Any) -> None:
    cli.add_command(stacks_cmd)
