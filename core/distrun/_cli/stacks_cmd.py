"""``distrun stacks [RUN]``: where every rank of a live run is, and every thread's stack.

From another terminal on a node of the run: the command reads the position records of the
run's ranks on this host, asks each for its stacks (:mod:`distrun._diagnose.stacks`), prints
the one-line summary the stall watcher would print, and writes the evidence to
``RUN/stacks-N/`` (a run without a folder: the temporary folder). A multi-node run: the
ranks of this node ask the other nodes' ranks through the run's store
(:mod:`distrun._diagnose.exchange`), and the line names every node's ranks (or the nodes whose
report did not come in time). A launcher that runs several groups on a node (``--ft``'s
replica groups): a line and a folder per group, the line led by the group's name.
"""

from __future__ import annotations

import os
import time
from typing import Any

import click

from distrun._spec.errors import UsageError
from distrun._spec.markers import hookimpl

__all__ = ["stacks_cmd"]


def _choose(run: str | None) -> list[tuple[str, dict[str, Any]]]:
    """The live worker groups of the run asked for: one, or the groups of one launcher that
    runs several on this node (``--ft``'s replica groups); of a run whose launchers each
    start one rank here (srun's tasks), one."""
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
    runs = {(i.get("run_dir") or i.get("name") or f) for f, i in live}
    if len(live) > 1 and len(runs) == 1 and not any(i.get("group") for _, i in live) and \
            all(int(i.get("nnodes") or 1) > 1 for _, i in live):
        # one run whose launchers each start one rank here (srun's tasks): one of them asks
        # the others, as it asks another node's
        return [min(live, key=lambda fi: int(fi[1].get("node_rank") or 0))]
    if len(live) > 1 and (len(runs) > 1 or not all(i.get("group") for _, i in live)):
        names = ", ".join(sorted(runs))
        raise UsageError(f"{len(runs)} runs are live on this host ({names}): name one, "
                         "`distrun stacks RUN`")
    return sorted(live, key=lambda fi: str(fi[1].get("group", "")))


@click.command("stacks")
@click.argument("run", required=False)
def stacks_cmd(run: str | None) -> None:
    """Print where each rank of a live RUN (its folder or name) is and write every thread's
    stack of each to RUN/stacks-N/ (without RUN: the one run live on this host)."""
    from distrun._diagnose.summary import summarize, write_evidence
    from distrun._diagnose.watcher import across_nodes, evidence_folder, node_views

    groups = _choose(run)
    info = groups[0][1]
    out = evidence_folder(str(info.get("run_dir") or info.get("log_dir") or ""), base="stacks")
    lines = []
    for folder, info in groups:
        views = node_views(folder)
        if not views:
            continue
        unseen = ""
        nnodes = int(info.get("nnodes") or 1)
        if nnodes > 1:
            views, unseen = across_nodes(folder, [v.rank for v in views], views, nnodes,
                                         int(info.get("node_rank") or 0),
                                         f"stacks-{os.getpid()}-{time.time_ns()}")
        name = str(info.get("group") or "")
        # several groups (--ft): a folder and a line each, named by the group
        where = os.path.join(out, name.replace(" ", "-")) if len(groups) > 1 else out
        now = time.monotonic()
        line = summarize(views, now, evidence=where + os.sep, title="positions", unseen=unseen,
                         unit=str(info.get("unit") or "node"))
        write_evidence(where, views, line, now)
        lines.append(f"{name}: {line}" if len(groups) > 1 else line)
    if not lines:
        raise UsageError("the run has no ranks running on this host yet (try again once they "
                         "started)")
    click.echo("\n".join(lines))


@hookimpl
def distrun_add_commands(cli: Any) -> None:
    cli.add_command(stacks_cmd)
