"""The layout matrix on real gloo ranks: saved by {single, ddp x2, fsdp x2, tp x2, fsdp+tp x4},
loaded by {single, ddp x2, fsdp x2, fsdp x4, tp x2}; model and optimizer tensors bit-equal.

Layouts are built with torch.distributed.tensor directly (st_layouts), so the matrix runs with
this plugin alone. ``plain`` x2 is DDP's layout (a full replica per rank)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from st_layouts import compare, load_layout, rank_save_and_load, save_layout

from distrun.testing import run_on_ranks

SOURCES = ["plainx1", "plainx2", "fsdpx2", "tpx2", "fsdp_tpx4"]
TARGETS = ["plainx1", "plainx2", "fsdpx2", "tpx2", "fsdpx4"]


@pytest.mark.slow
def test_every_saved_layout_loads_bit_equal_in_every_layout(tmp_path, cpu_backend):
    root = str(tmp_path)
    single = {"plainx1": save_layout("plain", os.path.join(root, "plainx1"), seed=1)}
    two = run_on_ranks(rank_save_and_load, 2, root, [("plain", 2), ("fsdp", 3), ("tp", 4)],
                       ["plain", "fsdp", "tp"], single, init_process_group=True, timeout=240,
                       backend=cpu_backend)
    saved2 = two[0]["saved"]
    four = run_on_ranks(rank_save_and_load, 4, root, [("fsdp_tp", 5)], ["fsdp"],
                        {**single, **saved2}, init_process_group=True, timeout=240,
                        backend=cpu_backend)
    saved4 = four[0]["saved"]
    late = run_on_ranks(rank_save_and_load, 2, root, [], ["plain", "fsdp", "tp"], saved4,
                        init_process_group=True, timeout=240, backend=cpu_backend)
    cells: dict[str, list[str]] = {}
    for results in (two, four, late):
        for rank, result in enumerate(results):
            for cell, bad in result["cells"].items():
                cells.setdefault(cell, []).extend(f"rank {rank}: {b}" for b in bad)
    everything = {**single, **saved2, **saved4}
    for key, ref in everything.items():
        got, who, _ = load_layout("plain", ref["path"])
        bad = compare(got, ref["tensors"]) + ([] if who == 0 else [f"state.who={who}"])
        cells[f"{key} -> plainx1"] = bad
    _assert_each_rank_wrote_a_part(saved2["plainx2"]["path"], 2)
    assert sorted(cells) == sorted(f"{s} -> {t}" for s in SOURCES for t in TARGETS)
    failed = {cell: bad for cell, bad in cells.items() if bad}
    assert failed == {}, failed



def _assert_each_rank_wrote_a_part(path: str, world: int) -> None:
    """No rank wrote the whole model: replicated (DDP) tensors are split across ranks."""
    from distrun_safetensors.files import DTYPE_SIZES

    index = json.loads(Path(os.path.join(path, "model.safetensors.index.json")).read_text())
    per_file: dict[str, int] = {}
    for info in index["distrun"]["tensors"].values():
        for piece in info["pieces"]:
            n = DTYPE_SIZES[info["dtype"]]
            for d in piece["shape"]:
                n *= d
            per_file[piece["file"]] = per_file.get(piece["file"], 0) + n
    total = index["metadata"]["total_size"]
    assert sum(per_file.values()) == total
    assert len(per_file) == world and all(0 < b < 0.7 * total for b in per_file.values()), \
        (per_file, total)
