"""distrun-deepspeed: ZeRO 1-3 through DeepSpeed's engine train as DDP does, and their
checkpoints (distrun's format) resume bit-exact and load at another world size or strategy."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install distrun-deepspeed)")

from distrun.testing import free_port, run_cli, run_on_ranks  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))  # ds_tasks, importable by spawned ranks too
from ds_tasks import fit_all  # noqa: E402

COMMON = dict(batch_size=16, max_steps=6, seed=2, timeout=120, log_every_n_steps=1)


def _stage3_config(folder: Path) -> str:
    """ZeRO-3 with every parameter partitioned (DeepSpeed keeps small ones whole otherwise)."""
    path = folder / "zero3.json"
    path.write_text(json.dumps({"zero_optimization": {"stage3_param_persistence_threshold": 0}}))
    return str(path)


def _close(a: dict, b: dict, tol: float) -> None:
    assert a.keys() == b.keys()
    for name, value in a.items():
        diff = (b[name] - value).abs().max().item()
        assert diff <= tol, f"{name}: {diff:.3g}"


def test_each_zero_stage_trains_as_ddp_does(tmp_path):
    z3 = _stage3_config(tmp_path)
    runs = {
        "ddp": dict(strategy="ddp"),
        "ds1": dict(strategy="deepspeed", ds_stage=1),
        "ds2": dict(strategy="deepspeed", ds_stage=2),
        "ds3": dict(strategy="deepspeed", ds_stage=3, ds_config=z3),
        "ddp_accum_clip": dict(strategy="ddp", grad_accum=2, grad_clip=0.05),
        "ds2_accum_clip": dict(strategy="deepspeed", ds_stage=2, grad_accum=2, grad_clip=0.05),
        # a torch optimizer DeepSpeed has not tested trains under ZeRO as under ddp
        "ddp_sgd": dict(strategy="ddp", sgd=True),
        "ds2_sgd": dict(strategy="deepspeed", ds_stage=2, sgd=True),
    }
    listed = [dict(COMMON, run_dir=str(tmp_path / name), port=free_port(), **opts)
              for name, opts in runs.items()]
    per_rank = [dict(zip(runs, out, strict=True))
                for out in run_on_ranks(fit_all, 2, listed, timeout=400)]
    for rank in (0, 1):
        got = per_rank[rank]
        for name in ("ds1", "ds2", "ds3"):
            assert got[name]["engine"] == "DeepSpeedEngine" and got[name]["steps"] == 6
            _close(got["ddp"]["weights"], got[name]["weights"], 2e-5)
            for i, entry in got["ddp"]["optimizer"].items():  # the whole state, per parameter
                _close({k: v for k, v in entry.items() if k != "step"},
                       {k: v for k, v in got[name]["optimizer"][i].items() if k != "step"}, 1e-5)
        _close(got["ddp_accum_clip"]["weights"], got["ds2_accum_clip"]["weights"], 2e-5)
        assert got["ds2_sgd"]["engine"] == "DeepSpeedEngine"
        _close(got["ddp_sgd"]["weights"], got["ds2_sgd"]["weights"], 2e-5)
        # the clip mattered: without it the same accumulation lands elsewhere
        moved = max((got["ds2_accum_clip"]["weights"][k] - got["ds2"]["weights"][k]).abs().max()
                    for k in got["ds2"]["weights"])
        assert moved > 1e-3
    for name in runs:  # every rank holds the same whole weights
        _close(per_rank[0][name]["weights"], per_rank[1][name]["weights"], 0.0)


def test_a_zero_checkpoint_resumes_bit_exact_and_loads_at_any_world_size_or_strategy(tmp_path):
    z3 = _stage3_config(tmp_path)
    a = tmp_path / "a"
    runs = [
        dict(COMMON, strategy="deepspeed", ds_stage=2, ckpt_dir=str(a), ckpt_every_n_steps=3,
             run_dir=str(tmp_path / "ra")),
        dict(COMMON, strategy="deepspeed", ds_stage=2, resume=str(a / "step-3"),
             ckpt_dir=str(tmp_path / "b"), run_dir=str(tmp_path / "rb")),
        dict(COMMON, strategy="deepspeed", ds_stage=3, ds_config=z3, resume=str(a / "step-3"),
             ckpt_dir=str(tmp_path / "c"), ckpt_every_n_steps=3, run_dir=str(tmp_path / "rc")),
        dict(COMMON, strategy="ddp", stage="validate", resume=str(a / "step-6"),
             run_dir=str(tmp_path / "rd")),
    ]
    runs = [dict(opts, port=free_port()) for opts in runs]
    full, resumed, stage3, ddp = run_on_ranks(fit_all, 2, runs, timeout=400)[0]
    assert resumed["steps"] == full["steps"] == 6
    _close(full["weights"], resumed["weights"], 0.0)  # bit-exact
    for i, entry in full["optimizer"].items():
        _close(entry, resumed["optimizer"][i], 0.0)
    _close(full["weights"], stage3["weights"], 2e-5)  # stage 2 -> 3: other reductions
    _close(full["weights"], ddp["weights"], 0.0)
    # 2 ranks -> 1: the stage-3 run's own checkpoint, loaded by one DeepSpeed rank
    one = run_on_ranks(fit_all, 1, [dict(COMMON, strategy="deepspeed", ds_stage=2,
                                         stage="validate", resume=str(tmp_path / "c" / "step-6"),
                                         run_dir=str(tmp_path / "re"))], timeout=200)[0][0]
    _close(stage3["weights"], one["weights"], 0.0)
    for i, entry in stage3["optimizer"].items():
        _close({k: v for k, v in entry.items() if k != "step"},
               {k: v for k, v in one["optimizer"][i].items() if k != "step"}, 0.0)


def test_a_bad_ds_config_is_one_line_before_any_worker_starts(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text("{stage: 2")
    for path, words in ((tmp_path / "missing.json", "No such file"), (bad, "not JSON")):
        res = run_cli("run", "--nproc-per-node", "2", "--strategy", "deepspeed",
                      "--ds-config", str(path), "examples/digits.py", timeout=60,
                      cwd=Path(__file__).parents[3])
        assert res.returncode == 2, res.stderr
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and f"--ds-config {path}" in lines[0] and words in lines[0], \
            res.stderr
        assert "Traceback" not in res.stderr
