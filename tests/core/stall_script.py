"""A plain torchrun script whose rank 1 misbehaves at iteration 30 of its all-reduce loop,
as ``STALL_MODE`` says: ``sleep`` (a hang in Python), ``read`` (a read on a pipe nobody writes:
blocked in C), ``stop`` (SIGSTOP to itself) or ``skip`` (it skips an all-reduce). Writes the
time of the fault to ``STALL_MARK``."""

import os
import signal
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(4)
mode = os.environ.get("STALL_MODE", "sleep")
for i in range(10_000):
    if i == 30 and rank == 1:
        with open(os.environ["STALL_MARK"], "w") as fh:
            fh.write(repr(time.time()))
        if mode == "sleep":
            time.sleep(600)
        elif mode == "read":
            os.read(os.pipe()[0], 1)
        elif mode == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif mode == "skip":
            continue
    dist.all_reduce(t)
    if i % 10 == 0:
        dist.broadcast(t, 0)
