"""A Ray restart resumes a distrun task from its checkpoint and ends where an unbroken run does.

Needs the ddp strategy (two ranks) and the safetensors checkpoint plugin; skipped with the
reason when either is missing.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install ray, or tox -e contrib-ray)")
pytest.importorskip("distrun_ray", reason="distrun-ray is not installed (tox -e contrib-ray)")

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("distrun_ddp") is None,
                       reason="needs the ddp strategy: pip install distrun-ddp"),
    pytest.mark.skipif(importlib.util.find_spec("distrun_safetensors") is None,
                       reason="needs a checkpoint plugin: pip install distrun-safetensors"),
]

TASK = """
import json, os, sys
import torch
import distrun


class Regress(distrun.Task):
    def configure_model(self):
        return torch.nn.Linear(4, 1)

    def configure_optimizer(self, params):
        return torch.optim.SGD(params, lr=0.05)

    def train_data(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(96, 4, generator=g)
        return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))

    def training_step(self, model, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)


class CrashOnce:
    @distrun.hookimpl
    def distrun_on_fit_start(self, run):
        self.start_step = run.progress.step

    @distrun.hookimpl
    def distrun_on_step_end(self, run, step):
        if step == 3 and run.rank == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" \\
                and os.environ.get("CRASH") == "1":
            os._exit(7)

    @distrun.hookimpl
    def distrun_on_fit_end(self, run):
        if run.is_global_zero:
            weights = [p.detach().flatten().tolist() for p in run.unwrapped_model().parameters()]
            with open(sys.argv[1], "w") as fh:
                json.dump({"start_step": self.start_step, "step": run.progress.step,
                           "resumed_from": run.resumed_from, "weights": weights}, fh)


if __name__ == "__main__":
    distrun.Trainer(plugins=(CrashOnce(),)).fit(Regress())
"""

COMMON = ["--strategy", "ddp", "--max-steps", "6", "--max-epochs", "10", "--batch-size", "8",
          "--ckpt-every-n-steps", "2", "--no-summary"]


@pytest.mark.slow
def test_restart_resumes_from_the_checkpoint(h, tmp_path, ray_address):
    (tmp_path / "task.py").write_text(TASK)
    ref = h.distrun("run", "--nproc-per-node", "2", *COMMON, "--name", "ref", "task.py",
                    str(tmp_path / "ref.json"), cwd=tmp_path)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    result = h.distrun("run", "--launcher", "ray", "--ray-address", ray_address,
                       "--ray-num-workers", "2", "--ray-max-restarts", "1", "--ray-env", "CRASH",
                       *COMMON,
                       "--name", "ray", "task.py", str(tmp_path / "ray.json"), cwd=tmp_path,
                       env=h.clean_env(CRASH="1"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rank 1 (Ray node 127.0.0.1) failed with exit code 7" in result.stderr
    got, want = (json.loads((tmp_path / n).read_text()) for n in ("ray.json", "ref.json"))
    assert got["resumed_from"] and "ray" in got["resumed_from"]
    assert got["start_step"] == 2  # the step-2 checkpoint; step 3 was lost with rank 1
    assert got["step"] == want["step"] == 6
    assert want["start_step"] == 0 and want["resumed_from"] is None
    # CPU, fixed seed, global data cursor: the resumed run ends with the same weights
    assert got["weights"] == want["weights"]
