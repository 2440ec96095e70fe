"""--ft-sync localsgd:N / diloco:N: the groups train alone between syncs, every N steps."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from distrun.testing import run_cli


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["localsgd", "diloco"])
def test_groups_sync_every_n_steps(ft, tmp_path, mode):
    r = run_cli("run", "--ft", "--replica-groups", "2", "--nproc-per-node", "1",
                "--strategy", "ddp", "--batch-size", "16", "--max-epochs", "99",
                "--max-steps", "36", "--timeout", "60", "--ft-heartbeat", "1", "--seed", "3",
                "--ft-sync", f"{mode}:4", "ft_task:Task", cwd=tmp_path, env=ft.env(tmp_path),
                timeout=240)
    assert r.returncode == 0, r
    rows = ft.rows(tmp_path)
    for g in (0, 1):  # the step hooks run at the syncs only, with both groups in
        mine = [row for row in rows if row["replica"] == g]
        assert [row["step"] for row in mine] == list(range(4, 37, 4))
        assert {row["participants"] for row in mine} == {2}
    losses = [row["loss"] for row in rows if row["replica"] == 0]
    assert losses[-1] < losses[0] / 2, losses  # it learns
    # after the last sync both groups hold the same weights, bit for bit
    weights = [load_file(tmp_path / f"weights-replica{g}-rank0.safetensors") for g in (0, 1)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_sync_refusals(ft, tmp_path):
    base = ["run", "--ft", "--replica-groups", "2", "--nproc-per-node", "1", "--strategy",
            "ddp", "--batch-size", "16", "--max-steps", "4"]
    r = run_cli(*base, "--ft-sync", "gossip:2", "ft_task:Task", cwd=tmp_path,
                env=ft.env(tmp_path), timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == (
        "error: --ft-sync 'gossip:2' is not localsgd:N or diloco:N (N >= 1 local steps "
        "between syncs)"), r
    r = run_cli(*base, "--ft-sync", "diloco:4", "--ckpt-every-n-steps", "6", "ft_task:Task",
                cwd=tmp_path, env=ft.env(tmp_path), timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == (
        "error: --ckpt-every-n-steps 6 is not a multiple of --ft-sync diloco:4: checkpoints "
        "are taken at syncs, where the groups' weights agree; use a multiple of 4"), r
