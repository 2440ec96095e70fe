"""The --ft tests' task, and a plugin (DISTRUN_PLUGINS=ft_task) that records what committed.

Each sample is (id, x, y). The plugin writes, for every committed step of every rank, the ids
that rank trained on, with its replica group, the quorum's participants and id, to
``$FT_RECORD/replica<G>-rank<R>.jsonl``; at the end of the fit each rank's weights go to
``$FT_RECORD/weights-replica<G>-rank<R>.safetensors``.

With ``FT_AWAIT_REPLACEMENT=1`` a survivor training alone after the hold waits for the
victim's replacement to start, then goes on slowly (0.25 s a step) while it is still alone, so
the replacement rejoins before the run ends.

``FT_KILL_STEP=S`` with ``FT_KILL_VICTIM=G``: the victim (a group under --ft, else a rank)
SIGKILLs itself at step S of its first life, after writing the time to ``killed-at``
(benchmarks/fault_tolerance.py).

``FT_STEP_SLEEP=S`` makes each step S seconds longer (a run that lasts while a test acts);
with ``FT_SLOW_UNTIL=PATH`` only until the file PATH exists (the test releases the run).
``FT_SLOW_MS=M`` with ``FT_SLOW_REPLICA=G`` (and ``FT_SLOW_RANK=R``: that rank alone) makes
group G's training_step M ms longer at every step: a straggler, named by the slow-rank check.

The hold hook (``FT_HOLD_STEP=S``, ``FT_HOLD_VICTIM=G``), in a group's first life only: at
step S each rank of the victim group writes its pid to ``$FT_RECORD/victim-held-rank<R>`` and
sleeps in its forward pass, so it never reaches the
gradient all-reduce; every other group's rank 0 writes ``$FT_RECORD/peer<G>-at-allreduce``
once the last gradient of its backward pass is produced, right before the loop issues the
cross-group all-reduce that cannot complete without the victim. The test kills the victim
group once both files exist: the peer is then waiting inside the all-reduce.

The hang (``FT_HANG_STEP=S``, ``FT_HANG_VICTIM=G``), in group G's first life only: at step S
rank 1 of group G writes the time to ``$FT_RECORD/hung-at`` and sleeps in its training_step
(a deadlock of one rank); its group's stall watcher is to name it and end the group.

The save hold (``FT_HOLD_SAVE_STEP=S``, ``FT_HOLD_VICTIM=G``), in group G's first life only:
when that group writes the durable checkpoint of step S, each of its ranks writes its files
into the checkpoint's temporary folder, then writes its pid to ``$FT_RECORD/saver-held-rank<R>``
and sleeps there, inside the save, before the commit (the test kills the group).
"""

from __future__ import annotations

import json
import os
import time

import torch

from distrun.plugin import StashKey, hookimpl

SAMPLES = 96
_pending: dict[str, list[int]] = {}


class Data(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(8, generator=g)
        return torch.tensor(i), x, x.sum(0, keepdim=True) * 0.5


class Task:
    def configure_model(self):
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def configure_optimizer(self, params):
        return torch.optim.AdamW(params, lr=1e-2)

    def train_data(self):
        return Data()

    def training_step(self, model, batch):
        ids, x, y = batch
        _pending["ids"] = ids.tolist()
        return torch.nn.functional.mse_loss(model(x), y)


def _where() -> tuple[str, int, int]:
    return (os.environ["FT_RECORD"], int(os.environ.get("DISTRUN_FT_REPLICA", "0")),
            int(os.environ.get("RANK", "0")))


def _is_victim() -> bool:
    """``FT_KILL_VICTIM`` names a replica group (under --ft) or a rank (otherwise), in the
    first life of the run only."""
    victim = int(os.environ["FT_KILL_VICTIM"])
    if "DISTRUN_FT_REPLICA" in os.environ:
        return os.environ.get("DISTRUN_FT_ATTEMPT") == "0" and \
            int(os.environ["DISTRUN_FT_REPLICA"]) == victim
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and \
        int(os.environ.get("RANK", "0")) == victim


def _touch(path: str) -> None:
    with open(path + ".tmp", "w") as fh:
        fh.write(str(os.getpid()))
    os.replace(path + ".tmp", path)


@hookimpl(wrapper=True)
def distrun_training_step(run, batch):
    slow_until = os.environ.get("FT_SLOW_UNTIL")
    if os.environ.get("FT_STEP_SLEEP") and not (slow_until and os.path.exists(slow_until)):
        time.sleep(float(os.environ["FT_STEP_SLEEP"]))
    if os.environ.get("FT_SLOW_MS"):
        _, replica, rank = _where()
        if replica == int(os.environ["FT_SLOW_REPLICA"]) and \
                rank == int(os.environ.get("FT_SLOW_RANK", rank)):
            time.sleep(float(os.environ["FT_SLOW_MS"]) / 1e3)
    kill = os.environ.get("FT_KILL_STEP")  # benchmarks: the victim dies by itself
    if kill and run.progress.step + 1 == int(kill) and _is_victim():
        where, _, _ = _where()
        with open(os.path.join(where, "killed-at"), "w") as fh:
            fh.write(repr(time.time()))
        os.kill(os.getpid(), 9)
    hold = os.environ.get("FT_HOLD_STEP")
    first_life = os.environ.get("DISTRUN_FT_ATTEMPT", "0") == "0"
    hang = os.environ.get("FT_HANG_STEP")
    if hang and first_life and run.progress.step + 1 == int(hang):
        where, replica, rank = _where()
        if replica == int(os.environ["FT_HANG_VICTIM"]) and rank == 1:
            with open(os.path.join(where, "hung-at"), "w") as fh:
                fh.write(repr(time.time()))
            time.sleep(600)  # stands for a deadlock
    if hold and first_life and run.progress.step + 1 == int(hold):
        where, replica, rank = _where()
        if replica == int(os.environ["FT_HOLD_VICTIM"]):
            _touch(os.path.join(where, f"victim-held-rank{rank}"))
            while True:  # until the test kills the group
                time.sleep(1)
        else:
            params = [p for p in run.model.parameters() if p.requires_grad]
            left = [len(params)]

            def produced(param):
                left[0] -= 1
                if left[0] == 0 and rank == 0:
                    _touch(os.path.join(where, f"peer{replica}-at-allreduce"))

            handles = [p.register_post_accumulate_grad_hook(produced) for p in params]
            run.stash[_HANDLES] = handles
    elif hold and first_life and run.progress.step + 1 > int(hold) and \
            _pending.get("participants") == 1 and os.environ.get("FT_AWAIT_REPLACEMENT"):
        # A survivor training alone gives the victim's replacement time to rejoin: it waits
        # for the replacement to start, then goes on slowly while it is still alone.
        where, replica, rank = _where()
        victim = int(os.environ["FT_HOLD_VICTIM"])
        started = os.path.join(where, f"pid-replica{victim}-rank0-attempt1")
        while not os.path.exists(started):
            time.sleep(0.05)
        time.sleep(0.25)
    return (yield)


_HANDLES: StashKey[list] = StashKey("ft_task.handles")


@hookimpl
def distrun_on_step_end(run, step, metrics):
    for h in run.stash.get(_HANDLES, None) or []:
        h.remove()
    run.stash[_HANDLES] = []
    where, replica, rank = _where()
    _pending["participants"] = int(metrics.get("ft_participants", 1))
    row = {"step": step, "ids": _pending.get("ids", []), "replica": replica,
           "participants": int(metrics.get("ft_participants", 1)),
           "quorum": int(metrics.get("ft_quorum_id", -1)), "attempt": int(os.environ.get(
               "DISTRUN_FT_ATTEMPT", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))),
           "t": time.time(), "loss": float(metrics["loss"])}
    with open(os.path.join(where, f"replica{replica}-rank{rank}.jsonl"), "a") as fh:
        fh.write(json.dumps(row) + "\n")


def _hold_inside_the_save(step: int) -> None:
    from distrun_safetensors import save

    where, _, rank = _where()
    write = save._write_rank_files

    def write_then_hold(job, tmp):
        report = write(job, tmp)
        if job["step"] == step:
            _touch(os.path.join(where, f"saver-held-rank{rank}"))
            while True:  # until the test kills the group
                time.sleep(1)
        return report

    save._write_rank_files = write_then_hold


@hookimpl
def distrun_on_fit_start(run):
    where, replica, rank = _where()
    attempt = os.environ.get("DISTRUN_FT_ATTEMPT", "0")
    hold_save = os.environ.get("FT_HOLD_SAVE_STEP")
    if hold_save and attempt == "0" and replica == int(os.environ["FT_HOLD_VICTIM"]):
        _hold_inside_the_save(int(hold_save))
    _touch(os.path.join(where, f"pid-replica{replica}-rank{rank}-attempt{attempt}"))


@hookimpl
def distrun_on_fit_end(run):
    from safetensors.torch import save_file

    where, replica, rank = _where()
    # under fsdp each rank holds its shards (DTensors): rank r's are compared with rank r's
    state = {k: (v.to_local() if hasattr(v, "to_local") else v).detach().contiguous()
             for k, v in run.unwrapped_model().state_dict().items()}
    save_file(state, os.path.join(where, f"weights-replica{replica}-rank{rank}.safetensors"))
