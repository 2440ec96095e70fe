"""The GPU lane's checks ``strategies``, ``tune`` and ``restart``, each run by lane.py in a
process of its own (``lane.py OUT --check NAME``): fsdp/ddp trained and checkpointed on CUDA
(the checkpoints packed for the CPU cross-check), the batch-size finder through a real
out-of-memory error, and a CUDA worker killed and restarted against torchrun.
Standard library only (the commands they start import torch).
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from lane_procs import PY, REPO, Result, _env, _probe_env, _run

HERE = Path(__file__).resolve().parent
ARTIFACT = "gpu_lane_ckpt.tar.gz"


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
                             "once: update _CUDA_PATCH in "
                             "benchmarks/gpu/strategies_tune_restart.py")
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
        sides = ["distrun-run"] if dry else ["torchrun-fix", "distrun-run", "distrun",
                                             "distrun-memory"]
        res.figures.update({"sides": sides, "kill_step": int(kill), "steps": int(steps),
                            "ranks": 2, "device": "cpu" if dry else "cuda:0 (both ranks)"})
        rows = {}
        for side in sides:
            if res.left() < 20:
                res.note(f"{side}: not run (time budget)")
                continue
            t0 = time.monotonic()
            ok, rec, respawn, start, load, _ = recovery.trial(
                side, work, 0, extra, timeout=min(res.left() - 5, 150))
            rows[side] = {"ok": ok, "recovery_s": rec, "detect_respawn_s": respawn,
                          "start_to_step_s": start, "load_s": load,
                          "seconds": round(time.monotonic() - t0, 1)}
            res.figures[side] = rows[side]
            print(f"{side}: {rows[side]}", flush=True)
            res.write()
        base = rows.get("torchrun-fix", {}).get("recovery_s")
        if base:
            for side, target in (("distrun-run", 0.5), ("distrun", 1.0),
                                 ("distrun-memory", 0.5)):
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
