"""Fault tolerance side by side: kill one of 3 replicas, restart everyone or keep going.

    python benchmarks/fault_tolerance.py            # 3 trials of each side
    python benchmarks/fault_tolerance.py --trials 10 # the issue's run (about 30 minutes here)
    python benchmarks/fault_tolerance.py --sides ft,restart

Every side trains the tests' task (tests/contrib/ft/ft_task.py: a small MLP, 96 samples,
global batch 48) for STEPS steps on 3 CPU processes with gloo; in the first life the victim
SIGKILLs itself at step KILL (after writing the time):

- ``torchrun``: plain DDP under ``torchrun --nproc-per-node 3 --max-restarts 1``, with a
  ``torch.save`` checkpoint every CKPT steps reloaded after the restart, written by hand as a
  torchrun user does (benchmarks/ft_torchrun_side.py; distrun not involved);
- ``restart``: ``distrun run --nproc-per-node 3 --strategy ddp --max-restarts 1`` with a
  checkpoint every CKPT steps (distrun-elastic + distrun-safetensors): every rank restarts and
  resumes from the newest checkpoint (torchrun's recovery, as distrun does it);
- ``ft``: ``distrun run --ft --replica-groups 3 --nproc-per-node 1 --strategy ddp`` with
  ``--ft-heartbeat HEARTBEAT``: the two other groups keep training, the victim's group restarts
  and heals from a live peer.

Printed per side (medians over the trials, each trial a fresh run folder): the steps lost
(committed steps trained again, summed over ranks), the survivors' stall (the longest gap
between two commits of a rank that did not die, around the kill, less the median step time),
the replacement's time (kill -> its first commit) next to its own start time (in the
uninterrupted run: launch -> the first commit of the rank that the trials kill), the final loss (MSE of rank 0's final
weights over the whole dataset) against an uninterrupted run of the same side, the success rate, and the steady state (steps/s without a
failure) of ``--ft`` against plain ddp on 3 ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TASK_DIR = ROOT / "tests" / "contrib" / "ft"
STEPS, KILL, CKPT, BATCH, HEARTBEAT = 600, 30, 10, 48, 1.0
RUN_TIMEOUT = 180  # seconds: a run takes about 30 here; one that hangs is a failed trial
COMMON = ["--batch-size", str(BATCH), "--max-epochs", "1000", "--max-steps", str(STEPS),
          "--seed", "3", "--timeout", "60", "--log-every-n-steps", "1", "--strategy", "ddp"]
TORCHRUN = "torchrun"  # the side that is not a distrun command line
SIDES = {
    TORCHRUN: [],  # its command line: _command
    "restart": ["--nproc-per-node", "3", "--max-restarts", "1", "--ckpt-every-n-steps",
                str(CKPT)],
    "ft": ["--ft", "--replica-groups", "3", "--nproc-per-node", "1", "--ft-heartbeat",
           str(HEARTBEAT)],
}
PLAIN = ["--nproc-per-node", "3"]


def _command(side: str, args: list[str], folder: Path) -> list[str]:
    if side == TORCHRUN:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
                "--max-restarts", "1", "--monitor-interval", "0.1", "--standalone",
                str(ROOT / "benchmarks" / "ft_torchrun_side.py"), str(folder), str(STEPS),
                str(BATCH), str(CKPT), "3"]
    return [sys.executable, "-m", "distrun", "run", *COMMON, *args, "--run-dir",
            str(folder / "run"), "ft_task:Task"]


def _run(args: list[str], folder: Path, kill: bool, side: str = "") -> tuple[int, float]:
    """Run one side in ``folder``; its exit code and seconds taken (the launch's wall-clock
    time is written to ``folder/launched-at``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISTRUN_FT_", "TORCHFT_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(TASK_DIR), DISTRUN_PLUGINS="ft_task",
               FT_RECORD=str(folder), FT_STEP_SLEEP="0.02")
    if kill:
        env.update(FT_KILL_STEP=str(KILL), FT_KILL_VICTIM="1")
    started = time.monotonic()
    (folder / "launched-at").write_text(repr(time.time()))
    # its own session, so a run that hangs goes whole (torchrun's workers included)
    proc = subprocess.Popen(_command(side, args, folder), cwd=folder, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        print(f"{side or 'run'}: still running after {RUN_TIMEOUT} s, killed (a trial that "
              "failed)", file=sys.stderr)
        return -9, time.monotonic() - started
    if proc.returncode != 0:
        print(err[-2000:], file=sys.stderr)
    return proc.returncode, time.monotonic() - started


def _rows(folder: Path) -> dict[tuple[int, int], list[dict]]:
    out: dict[tuple[int, int], list[dict]] = {}
    for path in sorted(folder.glob("replica*-rank*.jsonl")):
        replica = int(path.name.split("-")[0][len("replica"):])
        rank = int(path.stem.rsplit("rank", 1)[1])
        out[(replica, rank)] = [json.loads(line) for line in path.read_text().splitlines()]
    return out


def _measure(folder: Path, victim: tuple[int, int]) -> dict[str, float]:
    rows = _rows(folder)
    killed = float((folder / "killed-at").read_text())
    lost = 0
    for stream in rows.values():
        seen: set[int] = set()
        for row in stream:
            if row["step"] in seen:
                lost += 1  # this step was committed before, and trained again
            seen.add(row["step"])
    steps = [b["t"] - a["t"] for s in rows.values() for a, b in zip(s, s[1:])
             if b["t"] < killed - 1 or a["t"] > killed + 30]
    step_time = statistics.median(steps) if steps else 0.0
    survivors = [k for k in rows if k[0] != victim[0] and k != victim] if victim[0] else \
        [k for k in rows if k != victim]
    stalls = []
    for key in survivors:
        times = [r["t"] for r in rows[key]]
        before = max((t for t in times if t <= killed), default=killed)
        after = min((t for t in times if t > killed), default=float("nan"))
        stalls.append(after - before - step_time)
    back = min((r["t"] for r in rows[victim] if r["t"] > killed), default=float("nan"))
    return {"lost": lost, "stall": max(stalls), "replacement": back - killed,
            "loss": _final_loss(folder)}


def _start_time(folder: Path, victim: tuple[int, int]) -> float:
    """Seconds from the launch to the first commit of ``victim``'s rank (an uninterrupted run)."""
    launched = float((folder / "launched-at").read_text())
    return _rows(folder)[victim][0]["t"] - launched


def _victim(side: str) -> tuple[int, int]:
    return (1, 0) if side == "ft" else (0, 1)


def _final_loss(folder: Path) -> float:
    """The MSE over the whole dataset of rank 0's final weights (replica 0 under --ft)."""
    import torch
    from safetensors.torch import load_file

    sys.path.insert(0, str(TASK_DIR))
    import ft_task

    model = ft_task.Task().configure_model()
    model.load_state_dict(load_file(folder / "weights-replica0-rank0.safetensors"))
    data = ft_task.Data()
    with torch.no_grad():
        xs = torch.stack([data[i][1] for i in range(len(data))])
        ys = torch.stack([data[i][2] for i in range(len(data))])
        return float(torch.nn.functional.mse_loss(model(xs), ys))


def _rate(args: list[str]) -> float:
    """Steps/s of one uninterrupted run (rank 0 of replica 0), or NaN when it fails."""
    with tempfile.TemporaryDirectory(prefix="distrun-ftb-") as tmp:
        code, _ = _run(args, Path(tmp), kill=False)
        if code != 0:
            return float("nan")
        times = [r["t"] for r in _rows(Path(tmp))[(0, 0)]]
        return (len(times) - 1) / (times[-1] - times[0])


def _steady(trials: int) -> tuple[float, float]:
    """Median steps/s of ``--ft`` and of plain ddp, launches alternated trial by trial."""
    ft, plain = [], []
    for _ in range(trials):
        ft.append(_rate(SIDES["ft"]))
        plain.append(_rate(PLAIN))
    return statistics.median(ft), statistics.median(plain)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3, help="fault trials a side (0: none)")
    parser.add_argument("--steady", type=int, default=3,
                        help="uninterrupted launches a side for the steady state (0: none)")
    parser.add_argument("--sides", default=",".join(SIDES),
                        help=f"which sides, comma-separated (default: {','.join(SIDES)})")
    opts = parser.parse_args()
    trials, sides = opts.trials, {s: SIDES[s] for s in opts.sides.split(",")}
    baseline, start = {}, {}
    for side, args in (sides if trials else {}).items():
        with tempfile.TemporaryDirectory(prefix="distrun-ftb-") as tmp:
            code, _ = _run(args, Path(tmp), kill=False, side=side)
            ok = code == 0
            baseline[side] = _final_loss(Path(tmp)) if ok else float("nan")
            start[side] = _start_time(Path(tmp), _victim(side)) if ok else float("nan")
    results: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    for _ in range(trials):
        for side, args in sides.items():  # alternate the sides trial by trial
            with tempfile.TemporaryDirectory(prefix="distrun-ftb-") as tmp:
                code, _ = _run(args, Path(tmp), kill=True, side=side)
                if code == 0:
                    results[side].append(_measure(Path(tmp), _victim(side)))
    if trials:
        _table(results, trials, baseline, start)
    if not opts.steady:
        return 0
    ft_rate, plain_rate = _steady(opts.steady)
    print(f"steady state: --ft {ft_rate:.1f} steps/s, plain ddp {plain_rate:.1f} steps/s "
          f"(ratio {ft_rate / plain_rate:.2f}; medians of {opts.steady} launches each, "
          "alternated; each step sleeps 0.02 s in the task)")
    return 0


def _table(results: dict[str, list[dict[str, float]]], trials: int,
           baseline: dict[str, float], start: dict[str, float]) -> None:
    print(f"kill 1 of 3 replicas at step {KILL} of {STEPS} ({trials} trials a side; "
          f"--ft-heartbeat {HEARTBEAT:g}, restart checkpoints every {CKPT} steps)")
    print(f"{'side':<9} {'ok':>5} {'steps lost':>10} {'stall s':>8} {'replacement s':>13} "
          f"{'start s':>7} {'final loss':>10} {'uninterrupted':>13}")
    for side, got in results.items():
        def med(key: str, got: list[dict[str, float]] = got) -> float:
            return statistics.median(r[key] for r in got) if got else float("nan")

        print(f"{side:<9} {len(got):>2}/{trials:<2} {med('lost'):>10.0f} {med('stall'):>8.2f} "
              f"{med('replacement'):>13.2f} {start[side]:>7.2f} {med('loss'):>10.4f} {baseline[side]:>13.4f}")


if __name__ == "__main__":
    sys.exit(main())
