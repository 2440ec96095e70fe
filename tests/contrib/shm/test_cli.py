"""What a user of ``distrun run --backend shm`` is told when the backend cannot do the job."""

from __future__ import annotations

from pathlib import Path

from distrun.testing import run_cli

ASKS_ANY_SOURCE = """
import torch, torch.distributed as dist
import distrun

class Task(distrun.Task):
    def configure_model(self):
        return torch.nn.Linear(4, 1)
    def configure_optimizer(self, params):
        return torch.optim.SGD(params, lr=0.1)
    def train_data(self):
        return torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    def training_step(self, model, batch):
        x, y = batch
        t = torch.zeros(1)
        if dist.get_rank() == 0:
            dist.recv(t)  # from any source: shm does not implement it
        else:
            dist.send(t, 0)
        return torch.nn.functional.mse_loss(model(x), y)

if __name__ == "__main__":
    distrun.fit(Task())
"""

UINT32 = """
import torch, torch.distributed as dist
dist.init_process_group()
dist.all_reduce(torch.ones(2, dtype=torch.uint32))
"""


def test_an_operation_the_backend_lacks_is_one_line_exit_2(tmp_path: Path) -> None:
    script = tmp_path / "any_source.py"
    script.write_text(ASKS_ANY_SOURCE)
    result = run_cli("run", "--nproc-per-node", "2", "--backend", "shm", "--strategy", "ddp",
                     "--timeout", "30", str(script), cwd=tmp_path, timeout=180)
    assert result.returncode == 2, result
    assert ("error: the shm backend does not implement recvAnysource, which the ddp strategy "
            "calls (use --backend gloo, or another strategy)") in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def test_a_dtype_the_backend_lacks_names_it_in_a_plain_script(tmp_path: Path) -> None:
    script = tmp_path / "uint32.py"
    script.write_text(UINT32)
    result = run_cli("run", "--nproc-per-node", "2", "--backend", "shm", str(script),
                     cwd=tmp_path, timeout=180)
    # a plain script owns its errors (torchrun's behaviour: traceback, exit 1), and torch's
    # message names the backend, the operation and the dtypes it has
    assert result.returncode == 1, result
    assert "shm backend: allreduce does not support dtype UInt32 (float32, float64" \
        in result.stderr, result.stderr


def test_several_nodes_are_refused_before_any_worker(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    result = run_cli("run", "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1",
                     "--backend", "shm", str(script), cwd=tmp_path, timeout=60)
    assert result.returncode == 2, result
    assert result.stderr.strip() == (
        "error: backend 'shm' reaches the ranks of one machine only, but --nnodes is 2 (use "
        "--backend gloo for several nodes)"), result.stderr
