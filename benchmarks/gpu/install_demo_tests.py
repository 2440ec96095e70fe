"""The GPU lane's checks ``install``, ``demo`` and ``cuda_tests``, each run by lane.py in a
process of its own (``lane.py OUT --check NAME``): the tree installed without network and
importable, the README demo on the GPU without a flag, and the cuda/nccl-marked tests.
Standard library only (the commands they start import torch).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from lane_procs import PY, REPO, Result, _probe_env, _run, _tail

HERE = Path(__file__).resolve().parent

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
