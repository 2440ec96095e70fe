"""``distrun stacks [RUN]``: where every rank of a live run is, and every thread's stack.

From another terminal on a node of the run: the command reads the position records of the
run's ranks on this host, asks each for its stacks (:mod:`distrun._diagnose.stacks`), prints
the one-line summary the stall watcher would print, and writes the evidence to
``RUN/stacks-N/`` (a run without a folder: the temporary folder). A multi-node run shows the
ranks of the node where it is typed.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import click

from distrun._spec.errors import UsageError
from distrun._spec.markers import hookimpl

__all__ = ["stacks_cmd"]


def _choose(run: str | None) -> tuple[str, dict[str, str]]:
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
    from distrun._diagnose.position import read_position
    from distrun._diagnose.summary import summarize, write_evidence
    from distrun._diagnose.watcher import diagnose_group, evidence_folder

    folder, info = _choose(run)
    ranks: dict[int, tuple[int, int | None]] = {}
    for name in sorted(os.listdir(folder)):
        if name.startswith("rank") and name[4:].isdigit():
            pos = read_position(os.path.join(folder, name))
            if pos is not None:
                ranks[pos.rank] = (pos.pid, None)
    if not ranks:
        raise UsageError("the run has no ranks running on this host yet (try again once they "
                         "started)")
    views = diagnose_group(folder, ranks, socket.gethostname())
    out = evidence_folder(info.get("run_dir") or info.get("log_dir") or "", base="stacks")
    now = time.monotonic()
    line = summarize(views, now, evidence=out + os.sep, title="positions")
    write_evidence(out, views, line, now)
    click.echo(line)


@hookimpl
def distrun_add_commands(cli: Any) -> None:
    cli.add_command(stacks_cmd)
