"""The GPU lane (benchmarks/gpu) from the CPU machine.

- Its dry mode, as CI meets it (no CUDA device): one line, exit 0, and a results.json that
  names every check, each marked ``dry`` (its code path ran on the CPU at the smallest sizes),
  so the lane cannot rot between the rare runs on a GPU.
- The checkpoint cross-check: the fsdp and ddp checkpoints the lane saved on the GPU
  (``tests/data/gpu_lane/gpu_lane_ckpt.tar.gz``, copied from a GPU run's output folder) load
  on 2 gloo ranks, into FSDP and into replicas, bit-equal to the tensors the lane recorded.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

from distrun._launch.lifeline import die_with_parent
from distrun._launch.reaper import reaped
from distrun.testing import run_on_ranks

REPO = Path(__file__).resolve().parents[2]
LANE = REPO / "benchmarks" / "gpu"
ARTIFACT = REPO / "tests" / "data" / "gpu_lane" / "gpu_lane_ckpt.tar.gz"


def _lane_module() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_lane", LANE / "lane.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_dry_mode_says_one_line_exits_0_and_marks_every_check_dry(tmp_path):
    out = tmp_path / "out"
    # no CUDA device, as on CI (also where this machine has one): the lane's real dry path
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)
    # reaped: the lane's whole process tree (its checks start sessions of their own) ends
    # with this test
    proc = subprocess.run(reaped(["bash", str(LANE / "run.sh"), str(out)]), env=env,
                          capture_output=True, text=True, timeout=1400,
                          preexec_fn=die_with_parent())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    assert "dry run" in lines[0] and "no CUDA device" in lines[0], lines[0]
    results = json.loads((out / "results.json").read_text())
    assert results["mode"] == "dry"
    names = _lane_module().NAMES
    assert list(results["checks"]) == list(names)
    not_dry = {name: (entry["status"], entry.get("error", "")[-2000:])
               for name, entry in results["checks"].items() if entry["status"] != "dry"}
    assert not not_dry, not_dry
    assert (out / "lane.log").stat().st_size > 0
    assert "gpu_lane_ckpt.tar.gz" in results["artifacts"]
    assert sorted(_read_meta(out / "gpu_lane_ckpt.tar.gz")["runs"]) == ["ddp", "fsdp"]


def _read_meta(path: Path) -> dict[str, Any]:
    with tarfile.open(path) as tar:
        member = tar.extractfile("meta.json")
        assert member is not None
        return json.loads(member.read())


def cross_check(artifact: Path, folder: Path) -> dict[str, list[str]]:
    """Every saved run of ``artifact`` loaded on 2 gloo ranks into FSDP and into replicas:
    ``"<run> -> <layout>x2"``: the names that differ, per rank."""
    with tarfile.open(artifact) as tar:
        # "data": no member may land outside the folder (a filter since Python 3.12/3.11.4)
        tar.extractall(folder, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    meta = json.loads((folder / "meta.json").read_text())
    cells: dict[str, list[str]] = {}
    for name, run in sorted(meta["runs"].items()):
        for layout in ("fsdp", "plain"):
            per_rank = run_on_ranks(_rank_load_and_compare, 2, str(folder / run["checkpoint"]),
                                    str(folder / run["expected"]), layout,
                                    init_process_group=True, timeout=240)
            cells[f"{name} -> {layout}x2"] = [f"rank {r}: {bad}"
                                              for r, bad in enumerate(per_rank) if bad]
    return cells


def _rank_load_and_compare(rank: int, world: int, checkpoint: str, expected: str,
                           layout: str) -> list[str]:
    sys.path.insert(0, str(LANE))
    from lane_tasks import rank_load_and_compare

    return rank_load_and_compare(rank, world, checkpoint, expected, layout)


@pytest.mark.slow
def test_the_gpu_checkpoints_load_on_two_gloo_ranks_bit_equal(tmp_path):
    if not ARTIFACT.exists():
        pytest.skip(f"no checkpoint from a GPU run of the lane: copy OUT/gpu_lane_ckpt.tar.gz "
                    f"of `benchmarks/gpu/run.sh OUT` on a GPU machine to "
                    f"{ARTIFACT.relative_to(REPO)}")
    meta = _read_meta(ARTIFACT)
    assert meta["mode"] == "gpu", "this artifact was made by the lane's dry run, not on a GPU"
    assert sorted(meta["runs"]) == ["ddp", "fsdp"]
    assert all(run["param_device"].startswith("cuda") for run in meta["runs"].values()), meta
    cells = cross_check(ARTIFACT, tmp_path)
    assert sorted(cells) == ["ddp -> fsdpx2", "ddp -> plainx2", "fsdp -> fsdpx2",
                             "fsdp -> plainx2"]
    assert not any(cells.values()), cells
