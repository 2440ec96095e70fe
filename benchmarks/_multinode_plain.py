"""The plain torch workers of ``benchmarks/multinode.py``: no distrun, run as torchrun runs them.

    fault OUT STEPS TIMEOUT PACE EVERY    the fault trials' worker (any launcher)
    link OUT STEPS WARMUP                 the slow-link trials' hand-written DDP loop

``fault``: ``init_process_group("gloo", timeout=TIMEOUT)``, DDP on a small MLP, a fixed global
batch split over however many ranks there are, PACE seconds of sleep per step standing in for
a bigger model's compute, a ``torch.save`` checkpoint every EVERY steps (rank 0, written to a
temporary name and renamed) in ``OUT/ckpt`` (storage every host sees), resumed from the newest
one at every start. Every process appends to its own ``OUT/rec/<host>-<pid>.jsonl`` one line
when it starts (when the process began, the step it resumed from) and one per step finished
(time, world size, step).

``link``: the nanoGPT-style loop of ``benchmarks/step_overhead.py`` (DistributedSampler
DataLoader, DDP, zero_grad/forward/backward/step, the loss printed every 10 steps on rank 0) on
the ~5M-parameter MLP; rank 0 writes its steps/s after the warm-up to ``OUT``.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

#: the fault trials' global batch: 1, 2 and 3 ranks divide it
FAULT_BATCH = 48
#: the slow-link trials' model (input, hidden widths, classes) and global batch
LINK_MODEL = (512, (2048, 2048), 10)
LINK_BATCH = 64
LOG_EVERY = 10


def mlp(n_in: int, hidden: tuple[int, ...], n_out: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for width in hidden:
        layers += [nn.Linear(n_in, width), nn.ReLU()]
        n_in = width
    layers.append(nn.Linear(n_in, n_out))
    return nn.Sequential(*layers)


def link_data(steps: int) -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(0)
    n = steps * LINK_BATCH
    return torch.utils.data.TensorDataset(torch.randn(n, LINK_MODEL[0], generator=gen),
                                          torch.randint(0, LINK_MODEL[2], (n,), generator=gen))


def _newest(folder: str) -> str | None:
    steps = [int(n[5:-3]) for n in os.listdir(folder) if n.startswith("step-") and
             n.endswith(".pt")]
    return os.path.join(folder, f"step-{max(steps)}.pt") if steps else None


def _born() -> float:
    """The wall-clock time this process was started (from /proc, 10 ms resolution)."""
    with open("/proc/self/stat") as fh:
        ticks = int(fh.read().rpartition(")")[2].split()[19])
    with open("/proc/uptime") as fh:
        uptime = float(fh.read().split()[0])
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def fault(out: str, steps: int, timeout: float, pace: float, every: int) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(mlp(32, (64,), 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ckpts = os.path.join(out, "ckpt")
    os.makedirs(ckpts, exist_ok=True)
    first = 1
    newest = _newest(ckpts)
    if newest:
        state = torch.load(newest)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        first = state["step"] + 1
    os.makedirs(os.path.join(out, "rec"), exist_ok=True)
    host = socket.gethostname()
    with open(os.path.join(out, "rec", f"{host}-{os.getpid()}.jsonl"), "a",
              buffering=1) as record:

        def write(**fields: object) -> None:
            record.write(json.dumps({**fields, "host": host, "rank": rank, "world": world,
                                     "t": time.time()}) + "\n")

        write(event="start", resumed_from=first - 1, born=_born())
        per = FAULT_BATCH // world
        for step in range(first, steps + 1):
            gen = torch.Generator().manual_seed(step)
            x = torch.randn(FAULT_BATCH, 32, generator=gen)
            y = x.sum(dim=1, keepdim=True).sin()
            time.sleep(pace)
            mine = slice(rank * per, (rank + 1) * per)
            loss = F.mse_loss(model(x[mine]), y[mine])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            write(event="step", step=step)
            if rank == 0 and step % every == 0:
                path = os.path.join(ckpts, f"step-{step}.pt")
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                            "step": step}, path + ".tmp")
                os.replace(path + ".tmp", path)
    dist.destroy_process_group()


def link(out: str, steps: int, warmup: int) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(mlp(*LINK_MODEL))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = link_data(steps)
    sampler = torch.utils.data.DistributedSampler(data, seed=0, drop_last=True)
    loader = torch.utils.data.DataLoader(data, batch_size=LINK_BATCH // dist.get_world_size(),
                                         sampler=sampler, drop_last=True)
    start = 0.0
    for step, (x, y) in enumerate(loader, 1):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if step % LOG_EVERY == 0 and dist.get_rank() == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        if step == warmup:
            start = time.perf_counter()
    rate = (steps - warmup) / (time.perf_counter() - start)
    if dist.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump({"steps_per_s": rate}, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    kind, args = sys.argv[1], sys.argv[2:]
    if kind == "fault":
        fault(args[0], int(args[1]), float(args[2]), float(args[3]), int(args[4]))
    elif kind == "link":
        link(args[0], int(args[1]), int(args[2]))
    else:
        sys.exit(f"unknown worker {kind!r}: fault or link")
