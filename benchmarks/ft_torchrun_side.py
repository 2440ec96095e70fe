"""The torchrun side of benchmarks/fault_tolerance.py: plain DDP under ``torchrun
--max-restarts 1``, a ``torch.save`` checkpoint every CKPT steps, reloaded after a restart.

    torchrun --nproc-per-node 3 --max-restarts 1 benchmarks/ft_torchrun_side.py \\
        RECORD STEPS BATCH CKPT SEED

It trains what the distrun sides train (tests/contrib/ft/ft_task.py's model, data, AdamW and
sample order, the global batch split over the ranks) and records what they record: one row
per step and rank in ``RECORD/replica0-rank<R>.jsonl``, the final weights of rank 0 in
``RECORD/weights-replica0-rank0.safetensors``. ``FT_KILL_STEP`` / ``FT_KILL_VICTIM`` (a rank)
kill the victim in the first life, as ft_task does. This is what a torchrun user writes by
hand; distrun is not used.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "contrib" / "ft"))
import ft_task  # noqa: E402


def _order(seed: int, epoch: int, n: int) -> torch.Tensor:
    gen = torch.Generator()
    gen.manual_seed(seed * 1_000_003 + epoch)  # distrun's epoch order, for the same data
    return torch.randperm(n, generator=gen)


def main(record: Path, steps: int, batch: int, every: int, seed: int) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    task = ft_task.Task()
    model = torch.nn.parallel.DistributedDataParallel(task.configure_model())
    optimizer = task.configure_optimizer(model.parameters())
    data = ft_task.Data()
    ckpt = record / "torchrun-ckpt.pt"
    step = 0
    if ckpt.exists():  # the restart: everyone reloads the newest checkpoint
        state = torch.load(ckpt, weights_only=False)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
    per_epoch = len(data) // batch
    first_life = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    kill = int(os.environ.get("FT_KILL_STEP", "0"))
    victim = int(os.environ.get("FT_KILL_VICTIM", "-1"))
    sleep = float(os.environ.get("FT_STEP_SLEEP", "0"))
    out = open(record / f"replica0-rank{rank}.jsonl", "a")  # noqa: SIM115 (closed below)
    while step < steps:
        epoch, within = divmod(step, per_epoch)
        ids = _order(seed, epoch, len(data))[within * batch:(within + 1) * batch]
        mine = ids[rank * batch // world:(rank + 1) * batch // world].tolist()
        if sleep:
            time.sleep(sleep)
        if first_life and rank == victim and step + 1 == kill:
            (record / "killed-at").write_text(repr(time.time()))
            os.kill(os.getpid(), 9)
        _, x, y = torch.utils.data.default_collate([data[i] for i in mine])
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        step += 1
        out.write(json.dumps({"step": step, "ids": mine, "t": time.time(),
                              "loss": float(loss)}) + "\n")
        out.flush()
        if step % every == 0 and rank == 0:
            torch.save({"model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "step": step}, f"{ckpt}.tmp")
            os.replace(f"{ckpt}.tmp", ckpt)
    out.close()
    if rank == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in model.module.state_dict().items()},
                  record / "weights-replica0-rank0.safetensors")
    dist.destroy_process_group()


if __name__ == "__main__":
    folder, n, b, c, s = sys.argv[1:6]
    main(Path(folder), int(n), int(b), int(c), int(s))
