"""Soak: many real launches of the ways a run ends, counting what went wrong. Printed only.

    python benchmarks/soak.py                   # 4 launches of each case (in `tox -e bench`)
    python benchmarks/soak.py --launches 34     # 204 launches in all
    python benchmarks/soak.py --load 0          # on a quiet machine (default: a hog per core)

Cases, each a 2-process ``distrun run`` on this machine (the task and its recording plugin
are the lifecycle tests' own, ``tests/core/lifecycle_task.py``):

- ``ddp-finished``: a short DDP run that trains to the end (want: exit 0);
- ``never-destroys``: a plain torchrun script that never destroys its process group (0);
- ``join-early-stop``: uneven per-rank data under Join, rank 1 asks to stop at step 14 (0);
- ``user-error``: rank 1 raises a user error at step 3 (2, from the failing rank);
- ``sigterm-requeue``: SIGTERM to the launcher mid-training (143), then a relaunch with
  ``--resume auto`` trains to the end (0): every step trained exactly once in all;
- ``kill9-launcher``: ``kill -9`` of the launcher mid-training (-9 for the launcher).

Per case: launches, the exit codes seen, aborts (``terminate called`` in the output or exit
134), orphans (workers alive 2 s after their launcher exited), and for the requeue case the
steps trained twice or never. Targets (issue 14): 0 aborts, 0 orphans, 0 duplicate steps.
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests" / "core"
sys.path.insert(0, str(TESTS))
from lifecycle_task import NEVER_DESTROYS, records  # noqa: E402

from distrun._launch.lifeline import pid_alive  # noqa: E402

TASK = f"{TESTS / 'lifecycle_task.py'}:Steps"
ABORT = "terminate called"



def _env(rec: Path, **extra: str) -> dict[str, str]:
    rec.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS),
                                                          os.environ.get("PYTHONPATH", "")]),
            "DISTRUN_PLUGINS": "lifecycle_task", "LC_REC": str(rec), "OMP_NUM_THREADS": "1",
            "DISTRUN_TIMEOUT": "60", "DISTRUN_SUMMARY": "0", **extra}


def _start(cwd: Path, args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "distrun", "run", "--nproc-per-node", "2",
                             *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _worker_pids(rec: Path) -> list[int]:
    return [r["pid"] for rank in range(2) for r in records(str(rec), "start", rank)]


def _orphans(rec: Path, script_pids: Path | None = None) -> int:
    """Workers still alive 2 s after their launcher exited."""
    time.sleep(2)
    pids = _worker_pids(rec)
    if script_pids is not None and script_pids.exists():
        pids += [int(p) for p in script_pids.read_text().split()]
    return sum(pid_alive(p) for p in pids)


def _wait_steps(proc: subprocess.Popen, rec: Path, rank: int, n: int, limit: float) -> None:
    deadline = time.monotonic() + limit
    while len(records(str(rec), "steps", rank)) < n and proc.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.05)


def one_launch(case: str, work: Path) -> dict:
    rec = work / "rec"
    ddp = ["--strategy", "ddp"]
    out = ""
    result = {"code": None, "abort": False, "orphans": 0, "dupes": 0, "missing": 0}
    if case == "ddp-finished":
        proc = _start(work, [*ddp, "--max-epochs", "1", TASK], _env(rec))
    elif case == "never-destroys":
        script = work / "never_destroys.py"
        script.write_text(NEVER_DESTROYS + "open(os.environ['PIDS'], 'a').write(f'{os.getpid()} ')\n")
        proc = _start(work, [str(script)], _env(rec, PIDS=str(work / "pids")))
    elif case == "join-early-stop":
        proc = _start(work, [*ddp, "--max-epochs", "3", "--join-mode", "join", TASK],
                      _env(rec, LC_UNEVEN="1", LC_STOP_AT="14@1"))
    elif case == "user-error":
        proc = _start(work, [*ddp, "--max-epochs", "3", TASK], _env(rec, LC_FAIL_AT="3@1"))
    elif case in ("sigterm-requeue", "kill9-launcher"):
        flags = [*ddp, "--max-epochs", "2", "--batch-size", "16", "--name", "soak",
                 "--resume", "auto", TASK]
        proc = _start(work, flags, _env(rec, LC_SLEEP="0.05"))
        _wait_steps(proc, rec, 1, 5, 120)
        proc.send_signal(signal.SIGTERM if case == "sigterm-requeue" else signal.SIGKILL)
    else:
        raise ValueError(case)
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    result["code"] = proc.returncode
    result["abort"] = ABORT in (out or "") or proc.returncode == 134
    result["orphans"] = _orphans(rec, work / "pids")
    if case == "sigterm-requeue":
        again = _start(work, flags, _env(rec))
        more, _ = again.communicate(timeout=300)
        result["abort"] |= ABORT in more or again.returncode == 134
        result["code"] = f"{proc.returncode}->{again.returncode}"
        for rank in range(2):
            steps = [r["step"] for r in records(str(rec), "steps", rank)]
            result["dupes"] += len(steps) - len(set(steps))
            result["missing"] += len(set(range(1, 33)) - set(steps))
    return result


CASES = ("ddp-finished", "never-destroys", "join-early-stop", "user-error", "sigterm-requeue",
         "kill9-launcher")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=4, help="launches of each case")
    parser.add_argument("--load", type=int, default=os.cpu_count() or 1,
                        help="CPU-bound processes kept busy during the soak (default: a core each)")
    parser.add_argument("--quick", action="store_true", help="2 launches of each case")
    parser.add_argument("cases", nargs="*", default=list(CASES))
    opts = parser.parse_args()
    launches = 2 if opts.quick else opts.launches
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(opts.load)]
    totals = collections.Counter()
    try:
        print(f"{launches} launches of each case, {opts.load} busy processes, "
              f"{os.cpu_count()} cores")
        print(f"{'case':18} {'launches':>8} {'aborts':>6} {'orphans':>7} {'dupes':>5} "
              f"{'missing':>7}  exit codes")
        for case in opts.cases:
            seen: collections.Counter = collections.Counter()
            row = collections.Counter()
            for i in range(launches):
                with tempfile.TemporaryDirectory(prefix=f"soak-{case}-{i}-") as tmp:
                    r = one_launch(case, Path(tmp))
                seen[str(r["code"])] += 1
                row.update(aborts=int(r["abort"]), orphans=r["orphans"], dupes=r["dupes"],
                           missing=r["missing"])
            totals.update(row, launches=launches)
            codes = ", ".join(f"{c} x{n}" for c, n in sorted(seen.items()))
            print(f"{case:18} {launches:8d} {row['aborts']:6d} {row['orphans']:7d} "
                  f"{row['dupes']:5d} {row['missing']:7d}  {codes}", flush=True)
        print(f"{'all':18} {totals['launches']:8d} {totals['aborts']:6d} "
              f"{totals['orphans']:7d} {totals['dupes']:5d} {totals['missing']:7d}")
    finally:
        for hog in hogs:
            hog.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
