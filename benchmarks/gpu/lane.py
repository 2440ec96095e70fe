"""The GPU lane: one unattended command that proves distrun's CUDA paths on a real GPU.

    benchmarks/gpu/run.sh OUT_DIR [CHECK ...]       # (runs this file)
    python benchmarks/gpu/lane.py OUT_DIR [CHECK ...] [--dry] [--budget SECONDS]

Installs the working tree without network, then runs every check (or those named) in a
process of its own with its own time limit, so that one failure or hang never stops the
rest, and writes ``OUT_DIR/results.json`` (one entry per check: its status, seconds, figures
and, when it failed, the last lines of its output), ``OUT_DIR/lane.log`` (everything every
check printed) and ``OUT_DIR/gpu_lane_ckpt.tar.gz`` (the small fsdp/ddp checkpoints that
tests/core/test_gpu_lane.py loads on 2 gloo ranks). README.md beside this file says how to
run it on the device machine and what each check measures.

Without a CUDA device (or with ``--dry``) it says so in one line and exits 0 after a dry run
of its own plumbing: every check runs its code path on the CPU at the smallest sizes and is
marked ``dry`` (``failed`` when even that broke). The CPU test tests/core/test_gpu_lane.py
runs this dry mode, so the lane cannot rot between GPU runs.

The checks live beside it: install_demo_tests.py and strategies_tune_restart.py (run as
``lane.py OUT --check NAME``, on lane_procs.py's plumbing) and inproc.py with step_check.py,
amp_check.py and ckpt_check.py (the in-process ones). This file and the ``--check`` modules
import only the standard library (the checks import torch in their processes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
PY = sys.executable
# its modules lie beside it; a test loads this file by its path, without this folder on sys.path
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from install_demo_tests import lane_cuda_tests, lane_demo, lane_install  # noqa: E402
from lane_procs import Result, _env, _kill_group, _tail, _tie  # noqa: E402
from strategies_tune_restart import lane_restart, lane_strategies, lane_tune  # noqa: E402

#: seconds kept for each check still to come when one check's limit is set
RESERVE = 20
#: the lane's whole budget (seconds) unless --budget or GPU_LANE_BUDGET says otherwise
BUDGET = 540


@dataclass
class Check:
    name: str
    budget: float  # seconds on the GPU (the dry run gets DRY_BUDGET)
    what: str


CHECKS = (
    Check("install", 90, "pip install --no-deps --no-build-isolation -e of the core and the "
          "plugins, the carried wheels; every module importable"),
    Check("demo", 60, "the README demo `distrun run examples/digits.py`, no flag: on the GPU?"),
    Check("cuda_tests", 90, "python -m pytest -m 'cuda or nccl' over the files that hold "
          "such tests (tox -e nccl's tests)"),
    Check("amp", 45, "bf16-mixed and 16-mixed (GradScaler, a forced overflow skipped) against "
          "a hand-written autocast loop"),
    Check("strategies", 90, "fsdp (bf16 mixed precision) and ddp at world size 1, and fsdp "
          "over a 1-rank NCCL group: train and checkpoint; the checkpoints kept for the CPU "
          "cross-check"),
    Check("step", 185, "distrun's loop against a hand-written loop, in-process, alternating: "
          "tiny_gpt and a ~100M GPT, eager and --compile"),
    Check("ckpt", 75, "checkpoint save/load GB/s of ~1 GB of GPU state against DCP and "
          "torch.save; async stall against a pinned device-to-host copy"),
    Check("tier", 150, "the memory tier's in-place saves of ~1 GB of GPU state into files "
          "registered with CUDA against pageable files and a pinned device-to-host copy; "
          "tiny_gpt at ~85M under distrun run with and without a memory checkpoint every "
          "step"),
    Check("tune", 60, "distrun tune batch-size finding the largest batch through a real CUDA "
          "out-of-memory error"),
    Check("restart", 130, "a CUDA worker killed and restarted: torchrun against distrun run "
          "(warm), distrun's own loop, and that loop with the memory tier, in the same run"),
)
NAMES = tuple(c.name for c in CHECKS)
DRY_BUDGET = 150


# -- the orchestrator --------------------------------------------------------------------------


def _probe_gpu() -> tuple[bool, str]:
    """(CUDA usable here, a line saying what this python/torch is)."""
    code = ("import torch; ok = torch.cuda.is_available(); "
            "print(ok, torch.__version__, torch.cuda.get_device_name(0) if ok else '-')")
    try:
        out = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return False, "importing torch took over 120 s"
    if out.returncode != 0:
        return False, f"torch does not import: {(out.stderr.strip().splitlines() or ['?'])[-1]}"
    ok, version, *name = out.stdout.split()
    return ok == "True", f"torch {version}, {' '.join(name)}"


def run_check(check: Check, out: Path, work: Path, limit: float, dry: bool,
              log: Any) -> dict[str, Any]:
    """Run one check in a process of its own (inproc.py for the in-process ones, this file's
    ``--check`` otherwise) within ``limit`` seconds; its entry of results.json."""
    result_file = work / f"{check.name}.json"
    if check.name in ("step", "amp", "ckpt", "tier"):
        cmd = [PY, str(HERE / "inproc.py"), check.name]
    else:
        cmd = [PY, str(HERE / "lane.py"), str(out), "--check", check.name]
    cmd += ["--result", str(result_file), "--seconds", f"{max(limit - 10, 5):.0f}"]
    if dry:
        cmd.append("--dry")
    env = _env(dry)
    started = time.monotonic()
    log.write(f"\n===== {check.name}: {check.what}\n===== limit {limit:.0f} s; "
              f"{' '.join(cmd)}\n")
    log.flush()
    output_file = work / f"{check.name}.out"
    timed_out = False
    with open(output_file, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                start_new_session=True, preexec_fn=_tie)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            rc = proc.returncode
        finally:
            if proc.poll() is None:
                _kill_group(proc)
    seconds = time.monotonic() - started
    text = output_file.read_text(errors="replace")
    log.write(text)
    log.write(f"\n===== {check.name}: exit {rc}{' (timed out)' if timed_out else ''} after "
              f"{seconds:.1f} s\n")
    log.flush()
    entry: dict[str, Any] = {"status": "ok", "seconds": round(seconds, 1),
                             "limit_s": round(limit), "what": check.what, "figures": {},
                             "notes": []}
    try:
        data = json.loads(result_file.read_text())
        entry["figures"], entry["notes"] = data.get("figures", {}), data.get("notes", [])
    except (OSError, ValueError):
        entry["notes"].append("the check wrote no result file")
    if timed_out:
        entry["status"] = "failed"
        entry["error"] = f"timed out after {limit:.0f} s (its figures so far are kept)\n" + \
            _tail(text)
    elif rc != 0:
        entry["status"] = "failed"
        entry["error"] = f"exit {rc}\n" + _tail(text)
    elif dry:
        entry["status"] = "dry"
    return entry



def orchestrate(out: Path, names: list[str], dry: bool, budget: float, why_dry: str) -> int:
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    deadline = started + budget
    work = Path(tempfile.mkdtemp(prefix="gpu-lane-"))
    checks = [c for c in CHECKS if c.name in names]
    results: dict[str, Any] = {
        "lane": "distrun GPU lane (benchmarks/gpu)",
        "mode": "dry" if dry else "gpu",
        "why_dry": why_dry if dry else None,
        "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": PY,
        "budget_s": budget,
        "checks": {},
        "artifacts": [],
    }

    def say(line: str) -> None:
        log.write(f"[lane] {line}\n")
        log.flush()
        if not dry:
            print(f"[lane] {line}", flush=True)

    def save() -> None:
        results["total_s"] = round(time.monotonic() - started, 1)
        results["artifacts"] = sorted(p.name for p in out.iterdir()
                                      if p.name not in ("results.json", "lane.log"))
        tmp = out / "results.json.tmp"
        tmp.write_text(json.dumps(results, indent=1))
        os.replace(tmp, out / "results.json")

    with open(out / "lane.log", "w") as log:
        say(f"{results['mode']} run of {', '.join(c.name for c in checks)}; budget "
            f"{budget:.0f} s; {why_dry}")
        for i, check in enumerate(checks):
            left = deadline - time.monotonic()
            later = len(checks) - i - 1
            limit = min(check.budget if not dry else DRY_BUDGET, left - RESERVE * later)
            if limit < 15:
                results["checks"][check.name] = {
                    "status": "skipped", "seconds": 0, "what": check.what, "figures": {},
                    "notes": [], "error": f"no time left in the lane's {budget:.0f} s budget"}
                say(f"{check.name}: skipped (no time left)")
                save()
                continue
            entry = run_check(check, out, work, limit, dry, log)
            results["checks"][check.name] = entry
            site = entry["figures"].get("site") if check.name == "install" else None
            if site:  # the packages went there: every later check imports them from there
                os.environ["PYTHONPATH"] = os.pathsep.join(
                    p for p in (site, os.environ.get("PYTHONPATH")) if p)
            say(f"{check.name}: {entry['status']} in {entry['seconds']:.1f} s "
                f"(limit {limit:.0f} s; lane at {time.monotonic() - started:.0f} s)")
            if entry["status"] == "failed":
                for line in entry.get("error", "").splitlines()[:1]:
                    say(f"  {line}")
            line = headline(check.name, entry["figures"])
            if line:
                say(f"  {line}")
            save()
        save()
        counts: dict[str, int] = {}
        for entry in results["checks"].values():
            counts[entry["status"]] = counts.get(entry["status"], 0) + 1
        summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        say(f"done in {time.monotonic() - started:.0f} s: {summary}; {out / 'results.json'}")
    shutil.rmtree(work, ignore_errors=True)
    if dry:
        print(f"{why_dry}: dry run of the GPU lane's plumbing, {len(checks)} "
              f"check{'s' * (len(checks) != 1)} ({summary}), results in "
              f"{out / 'results.json'}", flush=True)
        return 0
    return 0 if counts.get("ok", 0) == len(checks) else 1


def headline(name: str, fig: dict[str, Any]) -> str:
    """A check's main figures in one line (for the tool's output tail; the rest is in
    results.json)."""
    def pick(d: dict[str, Any], *keys: str) -> str:
        return ", ".join(f"{k} {d[k]}" for k in keys if d.get(k) is not None)

    try:
        if name == "install":
            return pick(fig, "device", "torch", "torch_cuda", "nccl_version", "editable_s", "site")
        if name == "demo":
            return pick(fig, "used_gpu_without_a_flag", "device", "val_acc", "seconds")
        if name == "cuda_tests":
            return pick(fig, "passed", "failures", "errors", "skipped", "collected")
        if name == "amp":
            return "; ".join(f"{p}: {pick(v, 'matches', 'losses_bit_equal', 'max_rel_loss_diff')}"
                             for p, v in fig.items() if isinstance(v, dict))
        if name == "strategies":
            return "; ".join(f"{r}: {pick(v, 'exit', 'param_device', 'backend', 'checkpoints')}"
                             for r, v in fig.items() if isinstance(v, dict) and "exit" in v)
        if name == "step":
            return "; ".join(
                f"{k}: {pick(v, 'torch_step_ms', 'distrun_ratio_median', 'distrun_extra_us_per_step', 'distrun_nonfinite_ignore_ratio_median')}"
                for k, v in fig.items() if isinstance(v, dict) and "rates" in v)
        if name == "ckpt":
            return pick(fig, "bytes", "ours_save_GBps", "torch_save_GBps", "dcp_save_GBps",
                        "dd_GBps", "ours_load_GBps", "dcp_load_GBps", "torch_load_GBps",
                        "stall_vs_pinned_copy", "ours_load_bit_equal")
        if name == "tier":
            return pick(fig, "bytes", "registered_ms", "pageable_ms", "pinned_copy_ms",
                        "registered_first_ms", "pageable_vs_registered",
                        "registered_vs_pinned_copy", "load_bit_equal") + "; launches: " + \
                pick(fig.get("launches", {}), "memory_vs_plain", "tier_said")
        if name == "tune":
            return pick(fig, "per_rank", "met_out_of_memory", "capped", "seconds")
        if name == "restart":
            parts = [f"{s}: {pick(fig[s], 'ok', 'recovery_s', 'load_s')}"
                     for s in fig.get("sides", []) if s in fig]
            parts.append(pick(fig, "ratio_distrun-run_vs_torchrun", "ratio_distrun_vs_torchrun",
                              "ratio_distrun-memory_vs_torchrun"))
            return "; ".join(p for p in parts if p)
    except Exception as exc:  # a summary line must never stop the lane
        return f"(no summary: {type(exc).__name__}: {exc})"
    return ""


LANE_CHECKS: dict[str, Callable[[Result, Path, bool], None]] = {
    "install": lane_install, "demo": lane_demo, "cuda_tests": lane_cuda_tests,
    "strategies": lane_strategies, "tune": lane_tune, "restart": lane_restart}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the output folder (results.json, lane.log, artifacts)")
    parser.add_argument("names", nargs="*", metavar="CHECK",
                        help=f"checks to run (default: all): {', '.join(NAMES)}")
    parser.add_argument("--dry", action="store_true",
                        help="the dry run even where a GPU is present")
    parser.add_argument("--budget", type=float,
                        default=float(os.environ.get("GPU_LANE_BUDGET", BUDGET)),
                        help=f"the lane's seconds in all (default {BUDGET})")
    parser.add_argument("--check", choices=sorted(LANE_CHECKS), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=60.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    if args.check:  # one check, in its own process (run_check)
        res = Result(args.result, args.seconds)
        res.write()
        LANE_CHECKS[args.check](res, out, args.dry)
        res.write()
        return 0
    unknown = [n for n in args.names if n not in NAMES]
    if unknown:
        parser.error(f"unknown check {', '.join(unknown)}: choose from {', '.join(NAMES)}")
    names = args.names or list(NAMES)
    gpu, what = _probe_gpu()
    dry = args.dry or not gpu
    why = what if gpu and not args.dry else (
        f"--dry asked ({what})" if args.dry else f"no CUDA device is visible ({what})")
    return orchestrate(out, names, dry, args.budget if not dry else 10 * DRY_BUDGET, why)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
