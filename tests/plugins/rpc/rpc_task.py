"""The script the rpc tests run with ``distrun run``: a tiny task and a recorder plugin.

    distrun run --nproc-per-node 3 --strategy rpc rpc_task.py --out result.json [--hybrid]
        [--die-rank R --die-step N] [--hold DIR]

Trainer 0 writes ``--out``: final parameters (what the servers hold at the end), per-step
losses and each server's update count. ``--die-rank`` makes that rank vanish (``os._exit``)
at step ``--die-step``, as a crashed process would.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

import distrun
from distrun.plugin import hookimpl
from distrun_rpc.plugin import RPC_STRATEGY

EPOCHS, BATCH, SEED = 2, 32, 0


def synthetic(n: int = 256, seed: int = 7) -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen)
    w = torch.randn(8, 3, generator=gen)
    return torch.utils.data.TensorDataset(x, (x @ w).argmax(dim=1))


class TinyTask(distrun.Task):
    def __init__(self, die_rank: int = -1, die_step: int = -1, kill_server_step: int = -1,
                 hold: str = "") -> None:
        self.data = synthetic()
        self.die_rank, self.die_step = die_rank, die_step
        self.kill_server_step = kill_server_step
        self.hold = hold
        self.steps = 0

    def configure_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))

    def configure_optimizer(self, params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    def train_data(self):
        return self.data

    def training_step(self, model, batch):
        self.steps += 1
        if self.hold and self.steps == 1:  # every rank's servers are up: wait for the test
            open(os.path.join(self.hold, f"ready{os.environ['RANK']}"), "w").close()
            while not os.path.exists(os.path.join(self.hold, "go")):
                time.sleep(0.05)
        if self.steps == self.die_step and int(os.environ.get("RANK", "0")) == self.die_rank:
            os._exit(3)
        if self.steps == self.kill_server_step and int(os.environ.get("RANK", "0")) == 0:
            import torch.distributed.rpc as rpc

            rpc.rpc_async("server0", os._exit, args=(3,))  # the server vanishes mid-run
        x, y = batch
        return F.cross_entropy(model(x), y)


def reference_params() -> dict[str, torch.Tensor]:
    """TinyTask trained by a hand-written one-process loop, in distrun's data order."""
    import random

    from distrun._train.sampler import epoch_permutation

    random.seed(SEED)
    torch.manual_seed(SEED)  # what the loop seeds before configure_model
    task = TinyTask()
    model = task.configure_model()
    opt = task.configure_optimizer(model.parameters())
    x, y = task.data.tensors
    for epoch in range(EPOCHS):
        order = epoch_permutation(SEED, epoch, len(y))
        for start in range(0, len(y) - BATCH + 1, BATCH):
            idx = order[start:start + BATCH]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


class TinyHybridTask(TinyTask):
    """The first layer is an embedding table on the server; the head trains with DDP."""

    def __init__(self, **kw: int) -> None:
        super().__init__(**kw)
        gen = torch.Generator().manual_seed(3)
        labels = torch.randint(0, 3, (256,), generator=gen)
        ids = torch.randint(0, 21, (256, 4), generator=gen) * 3 + labels[:, None]
        self.data = torch.utils.data.TensorDataset(ids, labels)  # ids of class c are c mod 3

    def configure_remote(self) -> nn.Module:
        return nn.EmbeddingBag(64, 8, mode="mean")

    def configure_model(self) -> nn.Module:
        return nn.Linear(8, 3)

    def configure_optimizer(self, params):
        return torch.optim.Adam(params, lr=0.05)


class Recorder:
    """Collects trainer 0's losses, final parameters and the servers' update counts."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.losses: list[float] = []

    @hookimpl
    def distrun_on_step_end(self, run, step, metrics):
        if run.rank == 0:
            self.losses.append(float(metrics["loss"].detach()))

    @hookimpl
    def distrun_on_fit_end(self, run):
        from distrun_rpc import server

        st = run.stash.get(RPC_STRATEGY)
        result = {
            "role": os.environ.get("ROLE_NAME"), "role_rank": os.environ.get("ROLE_RANK"),
            "world_size": run.world_size, "dp_world_size": run.strategy.dp_world_size,
            "losses": self.losses,
            "params": {k: v.tolist() for k, v in run.unwrapped_model().state_dict().items()},
        }
        if st is not None:
            result["stats"] = [st.call(i, server.stats) for i in range(st.roles.servers)]
            if st.mode == "ddp":
                remote = st.server_state()["module"]
                result["remote"] = {k: v.tolist() for k, v in remote.items()}
        path = self.out if run.rank == 0 else f"{self.out}.rank{run.rank}"
        with open(path, "w") as fh:
            json.dump(result, fh)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--hybrid", action="store_true")
    parser.add_argument("--die-rank", type=int, default=-1)
    parser.add_argument("--die-step", type=int, default=-1)
    parser.add_argument("--kill-server-step", type=int, default=-1)
    parser.add_argument("--hold", default="", help="at step 1: write DIR/ready<RANK>, wait for "
                        "DIR/go (the test lists the run's sockets meanwhile)")
    args = parser.parse_args()
    cls = TinyHybridTask if args.hybrid else TinyTask
    task = cls(die_rank=args.die_rank, die_step=args.die_step,
               kill_server_step=args.kill_server_step, hold=args.hold)
    distrun.Trainer(plugins=(Recorder(args.out),), max_epochs=EPOCHS, batch_size=BATCH,
                    log_every_n_steps=4, summary=False).fit(task)


if __name__ == "__main__":
    main()
