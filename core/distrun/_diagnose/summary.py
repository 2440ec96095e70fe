"""From every rank's position, state and stack to one line that names the odd one out.

The ranks of a synchronous job wait for the slowest: when the job stops moving, the ranks
that got least far (fewest steps, an earlier phase of the step, fewer collectives of the
world entered) are the cause, and the others wait for them. Before that rule: a rank that is
stopped (SIGSTOP) or gone is named as such, whatever its last position said; ranks that all
wait in a collective of the same number but of different kinds called different collectives
(one skipped one); a rank at its epoch's end while others wait in a collective ran out of
batches (uneven inputs).

Torch-free: the launcher and ``distrun stacks`` compose it.
"""

from __future__ import annotations

import collections
import json
import os
from dataclasses import dataclass
from typing import Any

from distrun._diagnose.position import COLLECTIVES, PHASE_WORDS, Phase, Position, order
from distrun._diagnose.stacks import Stacks, parse_stacks

__all__ = ["RankView", "report_of", "summarize", "views_of", "write_evidence"]


@dataclass
class RankView:
    """What is known of one rank at the diagnosis."""

    rank: int
    host: str
    pid: int
    state: str  # running, stopped, zombie, gone, or "exited N"
    position: Position | None
    stacks: Stacks | None = None
    #: the user's line, as the rank's own node read it (a view from another node's report)
    line: str | None = None
    #: its processes worked while its node answered another node's look (a rank that works
    #: long is slow, not stalled: :mod:`distrun._diagnose.processes`)
    busy: bool = False

    def where(self) -> str:
        """`` at hang.py:17 (time.sleep(100))``, or "" when no frame of the user's shows."""
        if self.line is None:
            frame = self.stacks.user_frame() if self.stacks is not None else None
            self.line = frame.where() if frame is not None else ""
        return f" at {self.line}" if self.line else ""

    def who(self) -> str:
        return f"rank {self.rank} (host {self.host}, pid {self.pid})"

    def doing(self, now: float) -> str:
        """Where it is: ``in training_step for 61 s at hang.py:17 (time.sleep(100))``."""
        pos = self.position
        if self.state == "stopped":
            return "is stopped (SIGSTOP or a debugger): it runs nothing until SIGCONT"
        if self.state in ("gone", "zombie") or self.state.startswith("exited"):
            return f"has {self.state if self.state.startswith('exited') else 'exited'}"
        if pos is None:
            return "has no position yet (it has not started distrun's worker)"
        where = self.where()
        if pos.kind:
            phase = "" if pos.phase == Phase.SCRIPT else f" ({PHASE_WORDS[pos.phase]})"
            return f"waits in {pos.kind} #{pos.seq}{phase} for {_ago(now - pos.coll_since)}{where}"
        if pos.phase == Phase.SCRIPT:
            after = f" since collective #{pos.seq}" if pos.seq else ""
            return f"runs the script{after} for {_ago(now - pos.since)}{where}"
        return f"{PHASE_WORDS[pos.phase]} for {_ago(now - pos.since)}{where}"


def _ago(seconds: float) -> str:
    return f"{max(0.0, seconds):.0f} s"


_PLURAL = {"waits": "wait", "runs": "run", "is": "are", "has": "have"}


def _ranks(views: list[RankView]) -> str:
    nums = sorted(v.rank for v in views)
    return ("rank " if len(nums) == 1 else "ranks ") + ",".join(map(str, nums))


#: the phases of a plain script's rank (a DDP script's rank waits in backward)
_SCRIPT = (Phase.SCRIPT, Phase.BACKWARD, Phase.OPTIMIZER)


def _step_of(pos: Position) -> int:
    """The step a rank is in: the one it finished while it is in that step's end (its
    hooks, a checkpoint, the boundary, validation), else the next."""
    after = pos.step > 0 and order(pos.phase) < order(Phase.DATA)
    return pos.step if after else pos.step + 1


def summarize(views: list[RankView], now: float, evidence: str = "",
              title: str = "stall", unseen: str = "", unit: str = "node") -> str:
    """One line: the culprits first, then what the others do, then where the stacks are.
    ``title``: ``stall`` (the watcher's), else a look at a run that may be moving.
    ``unseen``: the nodes whose ranks are missing from ``views`` (they did not report), said
    in the line; no rank is then called "not behind" on the evidence of the others alone.
    ``unit``: what a group of the run is, ``node``, or ``rank`` where a launcher starts each
    rank (srun's tasks, Ray's actors)."""
    views = sorted(views, key=lambda v: v.rank)
    placed = [v.position for v in views
              if v.position is not None and v.position.phase != Phase.SERVING]
    head = title
    if placed and all(p.phase in _SCRIPT for p in placed) and not any(p.step for p in placed):
        head = f"{title} after collective #{min(p.seq for p in placed)}"
    elif placed:
        head = f"{title} at step {min(_step_of(p) for p in placed)}"
    culprits, why = _culprits(views, stalled=title == "stall" and not unseen)
    others = [v for v in views if v not in culprits]
    parts = [f"{v.who()} {v.doing(now)}" for v in culprits]
    if why:
        parts.append(why)
    for group in _same_doing(others):
        doing = group[0].doing(now)
        if len(group) > 1:  # "rank 0 waits", "ranks 0,2 wait"
            verb, _, rest = doing.partition(" ")
            doing = f"{_PLURAL.get(verb, verb)} {rest}"
        parts.append(f"{_ranks(group)} {doing}")
    if unseen:
        one = "," not in unseen
        if unit == "node":
            who, whose = f"the ranks of node{'' if one else 's'} {unseen} are", \
                "that node's" if one else "each node's"
        else:
            who, whose = f"rank {unseen} is" if one else f"ranks {unseen} are", \
                "its" if one else "each one's"
        own = f"; {whose} launcher prints its own line" if title == "stall" else ""
        parts.append(f"{who} not seen here ({'its report' if one else 'their reports'} did not "
                     f"come in time{own})")
    tail = f"; stacks: {evidence}" if evidence else ""
    return f"{head}: " + "; ".join(parts) + tail


def _culprits(views: list[RankView], stalled: bool) -> tuple[list[RankView], str]:
    """The ranks that hold the others up, and a sentence on why when the rule is not
    simply "least far"."""
    dead = [v for v in views if v.state != "running"]
    if dead:
        return dead, ""
    if not any(v.position is not None for v in views):
        return [], ""
    unplaced = [v for v in views if v.position is None]
    if unplaced:
        return unplaced, ""
    # a serving rank (RPC parameter server) takes no steps: it holds nobody up by that
    views = [v for v in views if v.position is None or v.position.phase != Phase.SERVING]
    pos = {v.rank: v.position for v in views if v.position is not None}
    odd = _diverged(views, pos)
    if odd is not None:
        return odd
    ended = [v for v in views if pos[v.rank].phase == Phase.EPOCH_END]
    if ended and any(pos[v.rank].phase in _TRAINING for v in views if v not in ended):
        return ended, ("it ran out of batches while the others still train (uneven inputs: "
                       "pip install distrun-join, or give every rank the same number of "
                       "batches)")
    least = min(p.key() for p in pos.values())
    behind = [v for v in views if pos[v.rank].key() == least]
    waiting = [v for v in behind if pos[v.rank].kind]
    if waiting and len(waiting) < len(behind):
        # as far as the others, but those wait in a collective (a pipeline's recv, say) and
        # these do not: these hold them up
        return [v for v in behind if not pos[v.rank].kind], ""
    in_user = [v for v in behind if v.stacks is not None and v.stacks.in_user_code()]
    if in_user and len(in_user) < len(behind):
        # as far as the others, none waits in a marked collective, but these run the user's
        # own code (a sleep, a read) where the others wait inside torch (a pipeline's wait)
        return in_user, ""
    if len(behind) == len(views):
        return [], ("no rank is behind the others: all are at the same place (a peer on "
                    "another node, the network, or a hang every rank shares)") if stalled \
            else ""
    return behind, ""


#: the phases of a step: a rank in one still expects the others' collectives of the epoch
_TRAINING = (Phase.DATA, Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER, Phase.STEP_END,
             Phase.BOUNDARY, Phase.CHECKPOINT)


def _diverged(views: list[RankView], pos: dict[int, Position],
              ) -> tuple[list[RankView], str] | None:
    """Ranks whose world collectives stopped matching the others': at the first number
    where the kinds differ (each rank remembers its last 32), the kind fewer ranks called
    marks the culprits (with two ranks, or a tie, nobody is named: the lines tell)."""
    if len(pos) < 2:
        return None
    low = max(max(p.seq for p in pos.values()) - 31, 1)
    for seq in range(low, min(p.seq for p in pos.values()) + 1):
        kinds = collections.Counter(p.kind_of(seq) for p in pos.values())
        if None in kinds or len(kinds) < 2:
            continue
        by_kind = {k: [v for v in views if pos[v.rank].kind_of(seq) == k] for k in kinds}
        said = ", ".join(f"{_ranks(group)} {COLLECTIVES[k - 1] if k else '?'}"
                         for k, group in by_kind.items())
        why = f"the ranks called different collectives as #{seq} ({said}): one skipped or " \
              "added one"
        counts = sorted(kinds.values())
        if counts[0] < counts[1]:
            return by_kind[min(kinds, key=lambda k: kinds[k])], why
        return [], why + " (compare their lines)"
    return None


def _same_doing(views: list[RankView]) -> list[list[RankView]]:
    """The ranks grouped by what they do: the same step, phase, collective and line."""
    groups: dict[str, list[RankView]] = {}
    for v in views:
        groups.setdefault(_bucket(v), []).append(v)
    return list(groups.values())


def _bucket(v: RankView) -> str:
    pos = v.position
    if pos is None or v.state != "running":
        return v.state
    return f"{pos.step}/{pos.phase}/{pos.kind}/{pos.seq}/{v.where()}"


def write_evidence(folder: str, views: list[RankView], summary: str, now: float) -> None:
    """``summary.txt``, and per rank ``rank<N>.txt``: its state, position and every thread's
    stack as the rank dumped it."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "summary.txt"), "w") as fh:
        fh.write(summary + "\n")
    for v in views:
        pos = v.position
        info = {"rank": v.rank, "host": v.host, "pid": v.pid, "state": v.state}
        if pos is not None:
            info.update(step=pos.step, phase=pos.phase.name.lower(),
                        phase_seconds=round(now - pos.since, 3), collective=pos.kind,
                        collective_number=pos.seq, seconds_per_step=round(pos.step_seconds, 6))
            if pos.kind:
                info["collective_seconds"] = round(now - pos.coll_since, 3)
        with open(os.path.join(folder, f"rank{v.rank}.txt"), "w") as fh:
            fh.write(f"{v.who()} {v.doing(now)}\n{json.dumps(info)}\n\n")
            fh.write(v.stacks.text if v.stacks is not None else
                     "(no stacks: the rank did not answer; see its state above)\n")


def report_of(views: list[RankView], now: float) -> dict[str, Any]:
    """One node's views as JSON-able data for the other nodes (times as ages: each host's
    monotonic clock is its own)."""
    out = []
    for v in views:
        item: dict[str, Any] = {"rank": v.rank, "host": v.host, "pid": v.pid, "state": v.state,
                                "line": v.where()[len(" at "):],
                                "stacks": v.stacks.text if v.stacks is not None else None,
                                "busy": v.busy}
        pos = v.position
        if pos is not None:
            item["position"] = {
                "pid": pos.pid, "armed": pos.armed, "phase": int(pos.phase),
                "age": now - pos.since, "kind": pos.kind, "seq": pos.seq,
                "coll_age": now - pos.coll_since, "step": pos.step,
                "step_seconds": pos.step_seconds, "ring": pos.ring.hex()}
        out.append(item)
    return {"views": out}


def views_of(report: dict[str, Any], now: float) -> list[RankView]:
    """The views another node's :func:`report_of` sent, on this host's clock."""
    views = []
    for item in report.get("views", []):
        p = item.get("position")
        pos = None if p is None else Position(
            item["rank"], p["pid"], p["armed"], Phase(p["phase"]), now - p["age"], p["kind"],
            p["seq"], now - p["coll_age"], p["step"], p["step_seconds"], bytes.fromhex(p["ring"]))
        stacks = parse_stacks(item["stacks"]) if item.get("stacks") else None
        views.append(RankView(item["rank"], item["host"], item["pid"], item["state"], pos,
                              stacks, item.get("line") or "", bool(item.get("busy"))))
    return views
