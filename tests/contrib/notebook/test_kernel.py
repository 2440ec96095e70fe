"""distrun-notebook in a real Jupyter kernel (ipykernel), driven by nbclient / jupyter_client."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="pip install nbformat (requirements-dev.txt)")
nbclient = pytest.importorskip("nbclient", reason="pip install nbclient (requirements-dev.txt)")
pytest.importorskip("ipykernel", reason="pip install ipykernel (requirements-dev.txt)")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from nb_procs import read_pids, survivors  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "notebook_launcher.ipynb"

DEFINE = '''
import os, sys
import torch, torch.distributed as dist
from torch import nn
from sklearn.datasets import load_digits

import distrun
from distrun_notebook import notebook_launcher


def all_reduce_ranks(scale):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    print(f"rank {rank} of {dist.get_world_size()}: sum {t.item()}")
    print(f"note from rank {rank}", file=sys.stderr)
    dist.destroy_process_group()
    return {"sum": t.item() * scale, "rank": rank, "pid": os.getpid()}


class Digits(distrun.Task):
    """A small MLP on scikit-learn's 8x8 digits (1,797 images, shipped with the package)."""

    def __init__(self):
        x, y = load_digits(return_X_y=True)
        self.data = torch.utils.data.TensorDataset(
            torch.tensor(x, dtype=torch.float32) / 16.0, torch.tensor(y))

    def configure_model(self):
        return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

    def configure_optimizer(self, params):
        return torch.optim.Adam(params, lr=0.01)

    def train_data(self):
        return self.data

    def training_step(self, model, batch):
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)
'''

LAUNCH_FN = '''
result = notebook_launcher(all_reduce_ranks, args=(10,), num_processes=2)
assert result["sum"] == 30.0 and result["rank"] == 0, result  # (1 + 2) * 10, from rank 0
assert result["pid"] != os.getpid()
'''

TRAIN = '''
import csv
fit = notebook_launcher(Digits, num_processes=2, strategy="ddp", max_epochs=2,
                        batch_size=64, log_every_n_steps=4, summary=False)
with open(os.path.join(fit.run_dir, "metrics.csv")) as fh:
    losses = [float(r["loss"]) for r in csv.DictReader(fh) if r["loss"]]
assert losses[-1] < 0.5 * losses[0], losses
assert open(os.path.join(fit.run_dir, "config.toml")).read().count('strategy = "ddp"') == 1
print("losses", losses[0], losses[-1], "steps", fit.step)
'''

NO_ORPHANS = f'''
sys.path.insert(0, {str(HERE)!r})
from nb_procs import descendants  # psutil when installed, else a walk of /proc
assert descendants() == [], descendants()
assert not dist.is_initialized() and not torch.cuda.is_initialized()
'''


def _text(cell, name: str) -> str:
    return "".join(o.get("text", "") for o in cell.outputs
                   if o.get("output_type") == "stream" and o.get("name") == name)


def test_notebook_runs_a_function_and_trains_a_task_with_ddp(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in (DEFINE, LAUNCH_FN, TRAIN, NO_ORPHANS)]
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError (with the cell's traceback) on a failed cell
    _, launch, train, _ = nb.cells
    # rank 0's output, and the other ranks' stderr marked with their rank, in the cell
    assert "rank 0 of 2: sum 3.0" in _text(launch, "stdout")
    assert "rank 1" not in _text(launch, "stdout")
    assert "note from rank 0" in _text(launch, "stderr")
    assert "[rank 1] note from rank 1" in _text(launch, "stderr")
    # the loop's lines from rank 0 (console logger, or distrun-progress when installed)
    assert re.search(r"step \d+.*\| loss \d\.\d+", _text(train, "stdout"))
    assert "[rank 1]" not in _text(train, "stdout")
    assert (tmp_path / "runs" / "notebook" / "metrics.csv").exists()


@pytest.mark.slow
def test_the_example_notebook_runs(tmp_path):
    nb = nbformat.read(EXAMPLE, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=180, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    assert (tmp_path / "runs" / "notebook" / "metrics.csv").exists()


SLEEPER = '''
import os, time
from distrun_notebook import notebook_launcher

def sleeper(folder):
    path = os.path.join(folder, f"rank{os.environ['RANK']}.pid")
    with open(path + ".tmp", "w") as fh:
        fh.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    while True:
        time.sleep(0.1)
'''


@pytest.mark.slow
def test_interrupting_the_kernel_stops_every_rank(tmp_path):
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", cwd=str(tmp_path))
    try:
        assert kc.execute_interactive(SLEEPER, timeout=60)["content"]["status"] == "ok"
        # stop_on_error=False: ipykernel otherwise aborts every request that reaches it while
        # it unwinds this cell's KeyboardInterrupt, and under load the check below did
        # (status 'aborted', no output); a person types the next cell later than that
        msg_id = kc.execute(f"notebook_launcher(sleeper, args=({str(tmp_path)!r},), "
                            "num_processes=2)", stop_on_error=False)
        pids = read_pids(tmp_path, 2)
        started = time.monotonic()
        km.interrupt_kernel()  # the notebook's stop button: SIGINT to the kernel's group
        reply = kc.get_shell_msg(timeout=60)
        assert reply["parent_header"]["msg_id"] == msg_id
        assert reply["content"]["status"] == "error"
        assert reply["content"]["ename"] == "KeyboardInterrupt"
        assert time.monotonic() - started < 15
        assert survivors(pids.values()) == []
        check = (f"import sys, json; sys.path.insert(0, {str(HERE)!r}); "
                 "from nb_procs import descendants; print(json.dumps(descendants()))")
        out: list[str] = []
        seen: list[dict] = []
        reply = kc.execute_interactive(check, timeout=30, output_hook=lambda m: (
            seen.append(m), out.append(m["content"].get("text", ""))
            if m["msg_type"] == "stream" else None))
        # (a failure shows what the kernel answered, not only an empty output)
        assert reply["content"]["status"] == "ok", (reply["content"], seen)
        assert json.loads("".join(out)) == [], seen
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)

