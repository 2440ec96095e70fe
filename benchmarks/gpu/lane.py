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

This file imports only the standard library (the checks import torch in their processes).
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
PY = sys.executable

#: what the lane installs, editable (pip install --no-deps --no-build-isolation -e ...):
#: the core and the plugins the checks and the cuda-marked tests use
EDITABLE = (".", "plugins/ddp", "plugins/fsdp", "plugins/safetensors", "plugins/elastic",
            "plugins/dp", "plugins_contrib/amp", "plugins_contrib/tune",
            "plugins_contrib/notebook")
#: the modules those provide, and the carried wheels' (crc32c: distrun-safetensors'
#: checksums; torchdata: the core's StatefulDataLoader, needed only for IterableDatasets)
MODULES = ("distrun", "distrun_ddp", "distrun_fsdp", "distrun_safetensors", "distrun_elastic",
           "distrun_dp", "distrun_amp", "distrun_tune", "distrun_notebook", "crc32c",
           "torchdata", "safetensors", "pluggy", "click", "sklearn", "matplotlib")
WHEELS = HERE / "wheels"
#: where the packages go when this python's own site-packages refuses them (then put first
#: on every later check's PYTHONPATH)
SITE = "/tmp/gpu-lane-site"
ARTIFACT = "gpu_lane_ckpt.tar.gz"
#: seconds kept for each check still to come when one check's limit is set
RESERVE = 20
#: the lane's whole budget (seconds) unless --budget or GPU_LANE_BUDGET says otherwise
BUDGET = 480


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
    Check("step", 170, "distrun's loop against a hand-written loop, in-process, alternating: "
          "tiny_gpt and a ~100M GPT, eager and --compile"),
    Check("ckpt", 75, "checkpoint save/load GB/s of ~1 GB of GPU state against DCP and "
          "torch.save; async stall against a pinned device-to-host copy"),
    Check("tune", 60, "distrun tune batch-size finding the largest batch through a real CUDA "
          "out-of-memory error"),
    Check("restart", 100, "a CUDA worker killed and restarted: torchrun against distrun run "
          "(warm) and distrun's own loop, in the same run"),
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


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _find_prctl() -> Any:
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: children are only stopped on timeouts
        return None


#: looked up once in the parent: no dlopen between fork and exec
_PRCTL = _find_prctl()


def _tie() -> None:
    """``preexec_fn``: this child gets SIGKILL when the process that started it dies
    (``PR_SET_PDEATHSIG``), so a killed lane or check leaves nothing running."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGKILL)


def _kill_group(proc: subprocess.Popen[Any]) -> None:
    """The check's whole process group (it was started in a session of its own)."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_check(check: Check, out: Path, work: Path, limit: float, dry: bool,
              log: Any) -> dict[str, Any]:
    """Run one check in a process of its own (inproc.py for the in-process ones, this file's
    ``--check`` otherwise) within ``limit`` seconds; its entry of results.json."""
    result_file = work / f"{check.name}.json"
    if check.name in ("step", "amp", "ckpt"):
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


def _env(dry: bool) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(HERE), str(REPO), os.environ.get("PYTHONPATH")) if p)
    if dry:
        env["OMP_NUM_THREADS"] = "1"  # a shared CPU machine: the dry run stays small
    return env


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
        if name == "tune":
            return pick(fig, "per_rank", "met_out_of_memory", "capped", "seconds")
        if name == "restart":
            parts = [f"{s}: {pick(fig[s], 'ok', 'recovery_s', 'load_s')}"
                     for s in fig.get("sides", []) if s in fig]
            parts.append(pick(fig, "ratio_distrun-run_vs_torchrun", "ratio_distrun_vs_torchrun"))
            return "; ".join(p for p in parts if p)
    except Exception as exc:  # a summary line must never stop the lane
        return f"(no summary: {type(exc).__name__}: {exc})"
    return ""


# -- the checks that run here (in a process of their own: `lane.py OUT --check NAME`) ---------


class Result:
    """A check's figures and notes, rewritten to ``path`` after each change."""

    def __init__(self, path: str, seconds: float) -> None:
        self.path = path
        self.deadline = time.monotonic() + seconds
        self.figures: dict[str, Any] = {}
        self.notes: list[str] = []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def note(self, text: str) -> None:
        print(f"[note] {text}", flush=True)
        self.notes.append(text)
        self.write()

    def write(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"figures": self.figures, "notes": self.notes}, fh, indent=1)
        os.replace(tmp, self.path)


def _run(cmd: list[str], res: Result, cwd: Path | str = REPO, env: dict[str, str] | None = None,
         limit: float | None = None) -> tuple[int, str, float]:
    """Run ``cmd`` (output echoed into this check's output); (exit code, output, seconds)."""
    print(f"$ {' '.join(cmd)}", flush=True)
    started = time.monotonic()
    limit = res.left() if limit is None else min(limit, res.left())
    proc = subprocess.Popen(cmd, cwd=cwd, env=env or _env(False), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=_tie)
    try:
        text, _ = proc.communicate(timeout=max(limit, 1))
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        text = (proc.stdout.read() if proc.stdout else "") + f"\n(timed out after {limit:.0f} s)"
        proc.returncode = 124
    seconds = time.monotonic() - started
    print(text, flush=True)
    print(f"(exit {proc.returncode}, {seconds:.1f} s)", flush=True)
    return proc.returncode, text, seconds


VERIFY = r"""
import importlib, importlib.metadata as md, json, sys
out = {"python": sys.version.split()[0], "imports": {}}
for name in sys.argv[1:]:
    try:
        mod = importlib.import_module(name)
        out["imports"][name] = getattr(mod, "__file__", None) or "namespace"
    except Exception as exc:
        out["imports"][name] = f"ERROR {type(exc).__name__}: {exc}"
import torch, torch.distributed as dist
out["torch"] = torch.__version__
out["torch_cuda"] = torch.version.cuda
out["cuda_available"] = torch.cuda.is_available()
out["nccl"] = dist.is_nccl_available()
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    out["device"] = p.name
    out["capability"] = f"{p.major}.{p.minor}"
    out["memory_gib"] = round(p.total_memory / 2**30, 1)
    out["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
out["distrun_entry_points"] = sorted(ep.name for ep in md.entry_points(group="distrun"))
print("VERIFY " + json.dumps(out))
"""


def lane_install(res: Result, out: Path, dry: bool) -> None:
    """Carried wheels, then the editable installs (GPU); what imports from where (both)."""
    wheels = sorted(glob.glob(str(WHEELS / "*.whl")))
    res.figures["wheels"] = [os.path.basename(w) for w in wheels]
    missing = [p for p in EDITABLE if not (REPO / p / "pyproject.toml").is_file()]
    if missing:
        raise SystemExit(f"no pyproject.toml in {', '.join(missing)}")
    editable = [arg for p in EDITABLE for arg in ("-e", p)]
    wheel_cmd = [PY, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                 "--no-cache-dir", *wheels]
    install_cmd = [PY, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                   "--no-build-isolation", *editable]
    res.figures["commands"] = [" ".join(wheel_cmd), " ".join(install_cmd)]
    if not wheels:
        res.note(f"no wheels in {WHEELS} (run benchmarks/gpu/prepare.sh here first and carry "
                 "that folder): crc32c is missing on the GPU machine, so distrun-safetensors "
                 "cannot checksum")
    if dry:
        rc, text, _ = _run([PY, "-m", "pip", "--version"], res)
        res.note("dry: the pip installs are not run (the tree is installed here already); "
                 "their command lines are in the figures")
    else:
        rc, text, seconds = _run(wheel_cmd, res) if wheels else (0, "", 0.0)
        res.figures["wheels_s"] = round(seconds, 1)
        if rc == 0:
            rc, text, seconds = _run(install_cmd, res)
            res.figures["editable_s"] = round(seconds, 1)
        if rc != 0:  # this python's site-packages refused: copies into SITE instead
            res.note(f"installing into {PY}'s environment failed ({_tail(text, 3)}); "
                     f"installing copies (not editable) into {SITE}, first on PYTHONPATH")
            target_cmd = [PY, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                          "--no-build-isolation", "--target", SITE, *wheels,
                          *(str(REPO / p) for p in EDITABLE)]
            rc, text, seconds = _run(target_cmd, res)
            res.figures.update({"site": SITE, "target_s": round(seconds, 1),
                                "commands": [*res.figures["commands"], " ".join(target_cmd)]})
            if rc != 0:
                raise SystemExit(f"installing failed, also into {SITE}:\n{_tail(text)}")
            os.environ["PYTHONPATH"] = os.pathsep.join(
                p for p in (SITE, os.environ.get("PYTHONPATH")) if p)
    rc, text, _ = _run([PY, "-c", VERIFY, *MODULES], res)
    line = next((ln for ln in text.splitlines() if ln.startswith("VERIFY ")), None)
    if line is None:
        raise SystemExit(f"the import check failed:\n{_tail(text)}")
    info = json.loads(line[len("VERIFY "):])
    res.figures.update(info)
    smi = shutil.which("nvidia-smi")
    if smi and not dry:
        rc, text, _ = _run([smi, "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                            "--format=csv,noheader"], res, limit=30)
        res.figures["nvidia_smi"] = text.strip()
    res.write()
    broken = {k: v for k, v in info["imports"].items() if str(v).startswith("ERROR")}
    if broken:
        raise SystemExit("not importable: " + "; ".join(f"{k}: {v}" for k, v in broken.items()))
    outside = [k for k, v in info["imports"].items() if k.startswith("distrun")
               and not str(v).startswith((str(REPO), res.figures.get("site") or str(REPO)))]
    if outside:
        res.note(f"imported from outside this tree: {', '.join(outside)}")
        if not dry:
            raise SystemExit(f"{', '.join(outside)} import from outside {REPO}")


def _probe_env(probe: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = _env(False)
    env["DISTRUN_PLUGINS"] = ",".join(p for p in (os.environ.get("DISTRUN_PLUGINS"),
                                                  "lane_probe") if p)
    env["GPU_LANE_PROBE"] = str(probe)
    env.update(extra or {})
    return env


def lane_demo(res: Result, out: Path, dry: bool) -> None:
    """`distrun run examples/digits.py` as the README has it: no flag (dry: fewer batches)."""
    with tempfile.TemporaryDirectory(prefix="gpu-lane-demo-") as tmp:
        probe = Path(tmp) / "probe.json"
        flags = ["--max-epochs", "1", "--limit-train-batches", "2",
                 "--limit-val-batches", "2"] if dry else []
        cmd = [PY, "-m", "distrun", "run", *flags, str(REPO / "examples" / "digits.py")]
        rc, text, seconds = _run(cmd, res, cwd=tmp, env=_probe_env(probe))
        res.figures.update({"command": "distrun run " + " ".join(
            [*flags, "examples/digits.py"]), "exit": rc, "seconds": round(seconds, 1)})
        acc = re.search(r"validation accuracy: ([0-9.]+)", text)
        res.figures["val_acc"] = float(acc.group(1)) if acc else None
        if probe.exists():
            info = json.loads(probe.read_text())
            res.figures.update({"device": info["device"], "param_device": info["param_device"],
                                "cuda_max_allocated": info["cuda_max_allocated"]})
            res.figures["used_gpu_without_a_flag"] = info["param_device"].startswith("cuda")
        res.write()
        if rc != 0:
            raise SystemExit(f"the demo failed (exit {rc})")
        if not probe.exists():
            raise SystemExit("the demo ran but the probe plugin wrote nothing")
        if not dry and not res.figures["used_gpu_without_a_flag"]:
            raise SystemExit(f"the demo trained on {res.figures['device']}, not the GPU")


def _marked_test_files() -> list[str]:
    files = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        text = path.read_text(errors="replace")
        if re.search(r"mark\.(cuda|nccl)\b", text):
            files.append(str(path.relative_to(REPO)))
    return files


def lane_cuda_tests(res: Result, out: Path, dry: bool) -> None:
    files = _marked_test_files()
    res.figures["files"] = files
    if not files:
        raise SystemExit("no test file under tests/ holds a cuda or nccl mark")
    with tempfile.TemporaryDirectory(prefix="gpu-lane-tests-") as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [PY, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", "-m", "cuda or nccl",
               f"--junitxml={junit}", *(["--collect-only"] if dry else []), *files]
        rc, text, seconds = _run(cmd, res)
        res.figures.update({"command": " ".join(cmd[1:]).replace(str(junit), "JUNIT"),
                            "exit": rc, "seconds": round(seconds, 1)})
        if dry:  # collected (and selected by their marks), not run
            res.figures["collected"] = text.strip().splitlines()[-1] if text.strip() else ""
            res.write()
            if rc != 0:
                raise SystemExit(f"collecting the cuda/nccl tests failed (exit {rc})")
            return
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        skipped: list[str] = []
        if junit.exists():
            root = ET.parse(junit).getroot()
            for case in root.iter("testcase"):
                counts["tests"] += 1
                for kind, key in (("failure", "failures"), ("error", "errors"),
                                  ("skipped", "skipped")):
                    for node in case.findall(kind):
                        counts[key] += 1
                        if kind == "skipped":
                            skipped.append(f"{case.get('name')}: {node.get('message')}")
        counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - \
            counts["skipped"]
        res.figures.update(counts)
        res.figures["skipped_reasons"] = skipped
        res.write()
        if rc != 0 or counts["failures"] or counts["errors"]:
            raise SystemExit(f"cuda/nccl tests: exit {rc}, {counts}")
        if counts["passed"] == 0 or skipped:
            raise SystemExit(f"cuda/nccl tests skipped on a GPU machine: {skipped}")


def lane_strategies(res: Result, out: Path, dry: bool) -> None:
    """fsdp and ddp at world size 1 train and save; their checkpoints and full tensors go into
    OUT/gpu_lane_ckpt.tar.gz for the CPU cross-check."""
    root = Path(tempfile.mkdtemp(prefix="gpu-lane-strategies-"))
    fsdp = ["--strategy", "fsdp", "--fsdp-param-dtype", "bfloat16",
            "--fsdp-reduce-dtype", "float32"]
    runs = [("fsdp", fsdp, {}), ("ddp", ["--strategy", "ddp"], {})]
    if not dry:
        runs.append(("fsdp_nccl", fsdp, {"GPU_LANE_NCCL": "1"}))
    else:
        res.note("dry: fsdp over a 1-rank NCCL group needs CUDA; not run")
    failed = []
    try:
        for name, flags, extra in runs:
            folder = root / name
            folder.mkdir()
            probe = folder / "probe.json"
            env = _probe_env(probe, {"GPU_LANE_EXPECTED": str(folder / "expected.safetensors"),
                                     **extra})
            cmd = [PY, "-m", "distrun", "run", "--nproc-per-node", "1", *flags,
                   "--max-steps", "6", "--batch-size", "8", "--ckpt-save-on-end",
                   "--ckpt-dir", str(folder / "ckpt"), "--run-dir", str(folder / "run"),
                   "--no-summary", f"{HERE / 'lane_tasks.py'}:XcheckTask"]
            rc, text, seconds = _run(cmd, res, cwd=folder, env=env,
                                     limit=max(res.left() / 2, 30))
            entry: dict[str, Any] = {"exit": rc, "seconds": round(seconds, 1),
                                     "flags": " ".join(flags), **extra}
            if probe.exists():
                entry.update(json.loads(probe.read_text()))
            steps = sorted(p.name for p in (folder / "ckpt").glob("step-*"))
            entry["checkpoints"] = steps
            res.figures[name] = entry
            res.write()
            if rc != 0 or not probe.exists() or not steps:
                failed.append(f"{name} (exit {rc}, checkpoints {steps})")
            elif not dry and not str(entry.get("param_device", "")).startswith("cuda"):
                failed.append(f"{name} trained on {entry.get('param_device')}, not the GPU")
            elif name == "fsdp_nccl" and entry.get("backend") != "nccl":
                failed.append(f"fsdp_nccl ran on {entry.get('backend')}, not nccl")
        _pack(root, out, res, dry)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if failed:
        raise SystemExit("strategies failed: " + "; ".join(failed))


def _pack(root: Path, out: Path, res: Result, dry: bool) -> None:
    """The fsdp and ddp checkpoints (their newest step only), expected tensors and probes, as
    one tar (the device tool brings back at most 8 files)."""
    meta = {"made_by": "benchmarks/gpu/lane.py strategies", "mode": "dry" if dry else "gpu",
            "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "runs": {}}
    target = out / ARTIFACT
    with tarfile.open(target, "w:gz") as tar:
        for name in ("fsdp", "ddp"):
            folder = root / name
            steps = sorted((folder / "ckpt").glob("step-*"),
                           key=lambda p: int(p.name.split("-")[1]))
            expected = folder / "expected.safetensors"
            if not steps or not expected.exists():
                continue
            tar.add(steps[-1], arcname=f"{name}/{steps[-1].name}")
            tar.add(expected, arcname=f"{name}/expected.safetensors")
            probe = json.loads((folder / "probe.json").read_text())
            meta["runs"][name] = {"checkpoint": f"{name}/{steps[-1].name}",
                                  "expected": f"{name}/expected.safetensors", **probe}
        blob = json.dumps(meta, indent=1).encode()
        info = tarfile.TarInfo("meta.json")
        info.size = len(blob)
        info.mtime = int(time.time())
        import io

        tar.addfile(info, io.BytesIO(blob))
    res.figures["artifact"] = {"file": ARTIFACT, "bytes": target.stat().st_size,
                               "runs": sorted(meta["runs"])}
    if target.stat().st_size > 1 << 20:
        res.note(f"{ARTIFACT} is {target.stat().st_size} bytes: over the 1 MB a test file "
                 "may be")
    res.write()


def lane_tune(res: Result, out: Path, dry: bool) -> None:
    with tempfile.TemporaryDirectory(prefix="gpu-lane-tune-") as tmp:
        flags = ["--device", "cpu", "--tune-max-memory", "8GiB", "--tune-max-batch", "2"] \
            if dry else ["--tune-max-batch", "4096"]
        env = _env(False)
        fraction = os.environ.get("GPU_LANE_TUNE_FRACTION", "0.1")
        env["GPU_LANE_TUNE_FRACTION"] = fraction
        if dry:
            env["GPU_LANE_TUNE_WIDTH"] = "1024"
        cmd = [PY, "-m", "distrun", "tune", "batch-size", *flags, "--run-dir",
               str(Path(tmp) / "run"), "--no-summary", f"{HERE / 'lane_tasks.py'}:OomTask"]
        rc, text, seconds = _run(cmd, res, cwd=tmp, env=env)
        res.figures.update({"command": "distrun tune batch-size " + " ".join(flags) +
                            " lane_tasks.py:OomTask", "exit": rc, "seconds": round(seconds, 1),
                            "memory_fraction": None if dry else float(fraction)})
        found = Path(tmp) / "run" / "tune" / "batch_size.json"
        if found.exists():
            data = json.loads(found.read_text())
            res.figures.update({k: data.get(k) for k in ("per_rank", "global", "capped",
                                                         "budget", "device")})
            res.figures["trials"] = [[t["batch"], t["fits"], t["out_of_memory"], t["peak"]]
                                     for t in data.get("trials", [])]
            res.figures["trials_columns"] = ["batch", "fits", "out_of_memory", "peak_bytes"]
            res.figures["met_out_of_memory"] = any(t["out_of_memory"]
                                                   for t in data.get("trials", []))
        res.write()
        if rc != 0 or not found.exists():
            raise SystemExit(f"distrun tune batch-size failed (exit {rc})")
        if not res.figures["per_rank"]:
            raise SystemExit("the finder found no batch that fits")
        if not dry and (not res.figures["met_out_of_memory"] or res.figures["capped"]):
            raise SystemExit("the finder never met an out-of-memory error")


#: recovery.PLAIN_SCRIPT's lines and their CUDA versions (model, data and the loaded
#: checkpoint on the GPU; both ranks share device 0 over gloo)
_CUDA_PATCH = (
    ("import torch, torch.distributed as dist\n",
     "import torch, torch.distributed as dist\n"
     "DEV = torch.device('cuda', 0) if torch.cuda.is_available() else torch.device('cpu')\n"),
    ("model = _net(nn)\n", "model = _net(nn).to(DEV)\n"),
    ("state = torch.load(ckpt)\n", "state = torch.load(ckpt, map_location=DEV)\n"),
    ("x, y = torch.randn(256, 8), torch.randn(256, 1)\n",
     "x, y = torch.randn(256, 8).to(DEV), torch.randn(256, 1).to(DEV)\n"),
)


def cuda_script(plain: str) -> str:
    """benchmarks/recovery.py's plain torch script with its model and data on the GPU."""
    for old, new in _CUDA_PATCH:
        if plain.count(old) != 1:
            raise SystemExit(f"benchmarks/recovery.py's script no longer has {old.strip()!r} "
                             "once: update _CUDA_PATCH in benchmarks/gpu/lane.py")
        plain = plain.replace(old, new)
    return plain


def lane_restart(res: Result, out: Path, dry: bool) -> None:
    """recovery.py's sides on CUDA workers (2 ranks on the one GPU, gloo): a rank killed,
    the run restarted once; torchrun against distrun's launcher (warm) in the same run."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import recovery

    work = Path(tempfile.mkdtemp(prefix="gpu-lane-restart-"))
    try:
        recovery.prepare(work)
        (work / "plain.py").write_text(cuda_script((work / "plain.py").read_text()))
        kill, steps = ("3", "4") if dry else ("10", "14")
        # NCCL refuses two ranks on one device: distrun's loop runs over gloo, as the plain
        # script does
        extra = {"BENCH_KILL_STEP": kill, "BENCH_STEPS": steps, "DISTRUN_BACKEND": "gloo"}
        sides = ["distrun-run"] if dry else ["torchrun-fix", "distrun-run", "distrun"]
        res.figures.update({"sides": sides, "kill_step": int(kill), "steps": int(steps),
                            "ranks": 2, "device": "cpu" if dry else "cuda:0 (both ranks)"})
        rows = {}
        for side in sides:
            if res.left() < 20:
                res.note(f"{side}: not run (time budget)")
                continue
            t0 = time.monotonic()
            ok, rec, respawn, start, load = recovery.trial(
                side, work, 0, extra, timeout=min(res.left() - 5, 150))
            rows[side] = {"ok": ok, "recovery_s": rec, "detect_respawn_s": respawn,
                          "start_to_step_s": start, "load_s": load,
                          "seconds": round(time.monotonic() - t0, 1)}
            res.figures[side] = rows[side]
            print(f"{side}: {rows[side]}", flush=True)
            res.write()
        base = rows.get("torchrun-fix", {}).get("recovery_s")
        if base:
            for side, target in (("distrun-run", 0.5), ("distrun", 1.0)):
                rec = rows.get(side, {}).get("recovery_s")
                if rec:
                    load = rows[side].get("load_s") or 0.0
                    res.figures[f"ratio_{side}_vs_torchrun"] = round(rec / (base + load), 3)
                    res.figures[f"target_{side}"] = target
        res.write()
        bad = [s for s in sides if not rows.get(s, {}).get("ok")]
        if bad:
            raise SystemExit(f"restart failed for: {', '.join(bad)}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


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
