"""A plugin written as a third party would, against ``distrun.plugin`` only
(tests/core/thirdparty_plugin: its own distribution with a strategy and a logger), found by
its entry point and run by ``distrun`` on two real gloo ranks."""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import tomllib

from distrun.testing import run_cli

PLUGIN = pathlib.Path(__file__).resolve().parent / "thirdparty_plugin"

TASK = """
import torch
import distrun


class Task(distrun.Task):
    def configure_model(self):
        torch.manual_seed(0)
        return torch.nn.Linear(4, 1)

    def train_data(self):
        x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))

    def training_step(self, model, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)
"""


@pytest.fixture
def installed(tmp_path) -> dict[str, str]:
    """The plugin on PYTHONPATH with the metadata pip would write from its pyproject (the
    ``distrun`` entry point), so distrun finds it the way it finds an installed plugin."""
    project = tomllib.loads((PLUGIN / "pyproject.toml").read_text())["project"]
    info = tmp_path / "site" / f"distrun_thirdparty-{project['version']}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\n"
                                   f"Version: {project['version']}\n")
    points = project["entry-points"]["distrun"]
    (info / "entry_points.txt").write_text(
        "[distrun]\n" + "".join(f"{k} = {v}\n" for k, v in points.items()))
    path = os.pathsep.join([str(PLUGIN), str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])
    return {"PYTHONPATH": path}


def test_listed_with_its_version_and_hooks(installed):
    result = run_cli("plugins", env=installed)
    assert result.returncode == 0, result
    block = result.stdout.split("thirdparty 0.1.0 (distrun-thirdparty)\n")[1]
    assert [ln.strip() for ln in block.splitlines()[:5]] == [
        "distrun_log_metrics", "distrun_on_fit_end", "distrun_on_fit_start",
        "distrun_register_options", "distrun_register_strategies"], result


def test_its_strategy_and_logger_run_on_two_ranks(installed, tmp_path):
    (tmp_path / "task.py").write_text(TASK)
    result = run_cli("run", "--nproc-per-node", "2", "--strategy", "averaged",
                     "--jsonl-every", "1", "--max-steps", "3", "--batch-size", "16",
                     "--run-dir", "out", "task.py:Task", cwd=tmp_path, env=installed)
    assert result.returncode == 0, result
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").open()]
    # metrics are reduced across ranks a few times a second and at the end of the fit
    assert rows and rows[-1]["step"] == 3, rows
    assert all(r["world"] == 2 and r["loss"] >= 0 for r in rows), rows
    # the layout check runs in the launcher, before any worker starts
    many = run_cli("run", "--nproc-per-node", "9", "--strategy", "averaged", "task.py:Task",
                   cwd=tmp_path, env=installed)
    assert many.returncode == 2, many
    assert "strategy 'averaged' runs on 8 ranks at most, not 9" in many.stderr, many
