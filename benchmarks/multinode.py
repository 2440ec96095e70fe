"""Multi-node side by side with torchrun, on network-namespace hosts (distrun.testing.hosts).

    python benchmarks/multinode.py                        # 2/1/1 fault trials, 3 launches
    python benchmarks/multinode.py --quick                # 1 of each
    python benchmarks/multinode.py --trials 10,5,5 --launches 5    # the issue's counts
    python benchmarks/multinode.py --only faults --sides distrun --faults partition

Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN), iproute2 and util-linux; says why and skips
where namespaces cannot be made. Every host is torn down at the end, also on Ctrl-C or SIGTERM.

**Faults.** One plain torch script (``_multinode_plain.py fault``: gloo with
``init_process_group(timeout=T)``, T = 60 s, DDP on a small MLP, a ``torch.save`` checkpoint
every 5 steps in a folder every host sees, resumed from the newest at every start, 100 steps of
~0.2 s) runs, one process per host, under each side's elastic agent with the same flags:
``--nnodes 1:3 --rdzv-backend c10d --rdzv-endpoint 198.18.0.1:29400 --rdzv-id J
--max-restarts 3 --rdzv-conf RDZV_CONF``, RDZV_CONF being the torch rendezvous timings distrun
derives from its default ``--heartbeat-timeout 15`` (given to both sides, so that torchrun gets
the same keep-alive and last call; torch's own defaults are 5 x 3 s and 30 s). Sides:

- ``torchrun``: ``python -m torch.distributed.run``, torch's defaults otherwise (its
  rendezvous store shared with the workers: restarts often fail, pytorch#167288);
- ``torchrun-fix``: the same with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``;
- ``distrun``: ``distrun run`` (distrun-elastic; heartbeat timeout 15 s, its default).

Each trial starts host0 (it serves the rendezvous) and host1 of a fresh testbed; once the
script has finished step 23 at 2 ranks, the fault: ``node-loss`` SIGKILLs every process of
host1; ``partition`` pulls host1's cable (restored when the trial ends); ``late-join`` starts
host2. Sides and trials alternate. Per side and fault:

- recovered: the hosts that should finish (host0; all three after a late join) exit 0 with
  step 100 done, and the run re-formed (1 rank; 3 after a late join) after the fault;
- recovery: seconds from the fault to the end of the first step at the new world size;
- steps lost: summed over the ranks before the fault, the last step each finished before it
  (after a join: before its agent stopped it) minus the step the re-formed run resumed from;
- hang: a launcher still running 3 x T (180 s) after the fault; it is then SIGKILLed;
- orphans: processes left on the hosts 2 s after the last launcher ended.

A lost host that dies takes its sockets with it, and both sides see the loss at once; a host
behind a cut link does not, and torchrun's survivors wait in a collective until T runs out,
while distrun's agents miss its heartbeat after the heartbeat timeout.

**Slow link.** DDP step time of 2 hosts x 1 process, ~5.3M-parameter MLP (21 MB of gradients
per all-reduce), global batch 64, both cables shaped to 1 Gbit/s (``tc tbf``) or left alone:
the hand-written loop under ``torchrun --nnodes 2`` (``_multinode_plain.py link``) against
distrun's loop (``_multinode_task.py``, ``distrun run --strategy ddp``), plain and with
``--ddp-comm-hook fp16`` or ``powersgd`` (rank 1, from step 2). Separate launches, alternated;
each times the steps after a warm-up of 10 from inside; medians.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _multinode_faults import FAULTS, SIDES, Trial, fault_settings, run_trial
from _multinode_link import KINDS, LINKS, link_launch

HERE = Path(__file__).resolve().parent


def _machine() -> str:
    import platform

    import torch

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{platform.node()}: {os.cpu_count()} cores, load average {load}; "
            f"torch {torch.__version__}, Python {platform.python_version()}")


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _show(value: float | None, unit: str = " s", fmt: str = ".1f") -> str:
    return f"{value:{fmt}}{unit}" if value is not None else "n/a"


# ---- faults ----------------------------------------------------------------------------------

def faults(counts: dict[str, int], sides: list[str], work: Path) -> dict:
    settings = fault_settings()
    print(f"faults: {settings}", flush=True)
    results: dict[tuple[str, str], list[Trial]] = {}
    for fault in FAULTS:
        for i in range(counts.get(fault, 0)):
            # rotate the order, so that no side always follows the same one
            for side in sides[i % len(sides):] + sides[:i % len(sides)]:
                began = time.monotonic()
                trial = run_trial(side, fault, i, work)
                results.setdefault((fault, side), []).append(trial)
                print(f"  {fault} {i + 1}/{counts[fault]} {side:<12}: {trial.line()} "
                      f"({time.monotonic() - began:.0f} s)", flush=True)
    _fault_table(results, sides)
    return results


def _fault_table(results: dict[tuple[str, str], list[Trial]], sides: list[str]) -> None:
    print(f"\n{'fault':<10} {'side':<13} {'recovered':>9} {'recovery':>9} {'respawn':>8} "
          f"{'x torchrun':>10} {'x tr-fix':>8} {'lost':>5} {'hangs':>5} {'orphans':>7}")
    for fault in FAULTS:
        med: dict[str, float | None] = {}
        for side in sides:
            trials = results.get((fault, side))
            if not trials:
                continue
            good = [t for t in trials if t.recovered]
            med[side] = _median([t.recovery_s for t in good if t.recovery_s is not None])
            lost = _median([float(t.lost) for t in good if t.lost is not None])
            respawn = _median([t.respawn_s for t in good if t.respawn_s is not None])
            ratios = []
            for base in ("torchrun", "torchrun-fix"):
                b = med.get(base)
                ratios.append(f"{med[side] / b:.2f}" if b and med[side] is not None else "n/a")
            print(f"{fault:<10} {side:<13} {len(good):>4}/{len(trials):<4} "
                  f"{_show(med[side]):>9} {_show(respawn):>8} {ratios[0]:>10} {ratios[1]:>8} "
                  f"{_show(lost, '', '.0f'):>5} {sum(t.hang for t in trials):>5} "
                  f"{sum(t.orphans for t in trials):>7}")
    print("recovery (fault -> first step of the re-formed run), respawn (fault -> its first "
          "worker began) and lost: medians over the recovered trials; hangs and orphans: "
          "totals; x torchrun: the recovery's ratio to that side's in this run (target <= 1)")
    print("what bounds a partition's recovery: torchrun, the collective timeout T (the "
          "survivors learn of the loss only when their all-reduce times out); distrun, the "
          "heartbeat timeout (--heartbeat-timeout, 15 s)")


# ---- slow link -------------------------------------------------------------------------------

def link(launches: int, steps: int, warmup: int, work: Path) -> None:
    print(f"\nslow link: 2 hosts x 1 process, {steps} steps (the first {warmup} untimed), "
          f"{launches} launch(es) of each kind on each link, alternated", flush=True)
    rates: dict[tuple[str, str], list[float]] = {}
    combos = [(lk, kind) for lk in LINKS for kind in KINDS]
    for i in range(launches):
        for lk, kind in combos[i % len(combos):] + combos[:i % len(combos)]:
            rate, why = link_launch(kind, lk, steps, warmup, work)
            if rate is None:
                print(f"  {lk:<8} {kind:<16} launch {i + 1}: FAILED ({why})", flush=True)
                continue
            rates.setdefault((lk, kind), []).append(rate)
            print(f"  {lk:<8} {kind:<16} launch {i + 1}: {rate:6.2f} steps/s", flush=True)
    print(f"\n{'link':<8} {'kind':<17} {'steps/s':>8} {'ms/step':>8} {'x torchrun':>10} "
          f"{'x distrun':>9}")
    for lk in LINKS:
        med = {k: _median(rates.get((lk, k), [])) for k in KINDS}
        for kind in KINDS:
            m = med[kind]
            vs_t = f"{m / med['torchrun']:.3f}" if m and med["torchrun"] else "n/a"
            vs_d = f"{m / med['distrun']:.2f}" if m and med["distrun"] else "n/a"
            print(f"{lk:<8} {kind:<17} {_show(m, '', '.2f'):>8} "
                  f"{_show(1000 / m if m else None, '', '.0f'):>8} {vs_t:>10} {vs_d:>9}")
    print("medians of steps/s; x torchrun: distrun's loop against the hand-written one (target "
          ">= 0.97 for plain distrun); x distrun: what the comm hook buys")


# ---- main ------------------------------------------------------------------------------------

def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="1 trial of each fault per side, 1 launch of each link kind")
    parser.add_argument("--trials", default="2,1,1", metavar="LOSS,CUT,JOIN",
                        help="trials per side of node loss, partition and late join "
                             "(default 2,1,1; the issue's counts: 10,5,5)")
    parser.add_argument("--launches", type=int, default=3,
                        help="slow-link launches of each kind on each link (default 3)")
    parser.add_argument("--only", choices=("faults", "link"), help="one half only")
    parser.add_argument("--sides", default=",".join(SIDES), help="fault sides to run")
    parser.add_argument("--faults", default=",".join(FAULTS), help="faults to run")
    parser.add_argument("--keep", metavar="DIR", help="keep every trial's logs and records "
                        "in DIR (default: a temporary folder, removed)")
    args = parser.parse_args(argv)
    counts = dict(zip(FAULTS, (int(n) for n in args.trials.split(","))))
    if args.quick:
        counts, args.launches = dict.fromkeys(FAULTS, 1), 1
    chosen = [f for f in args.faults.split(",") if f]
    counts = {f: n for f, n in counts.items() if f in chosen}
    sides = [s for s in args.sides.split(",") if s]
    unknown = (set(sides) - set(SIDES)) | (set(chosen) - set(FAULTS))
    if unknown:
        parser.error(f"unknown {', '.join(sorted(unknown))}: sides {SIDES}, faults {FAULTS}")

    from distrun.testing.hosts import unavailable

    why = unavailable()
    if why:
        print(f"multinode: skipped, no testbed here: {why}")
        return 0
    # SIGTERM unwinds like Ctrl-C: every testbed is a context manager and comes down
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(f"{datetime.date.today()}, {_machine()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="distrun-multinode-") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        if args.only != "link":
            faults(counts, sides, work)
        if args.only != "faults":
            link(args.launches, 80, 10, work)
    print(f"done; load average now {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
