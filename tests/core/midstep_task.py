"""A task whose rank 1 dies mid-run while rank 0 works through a long step: what a launcher
does with a failed rank's survivor (tests/core/test_launch.py, tests/plugins/elastic).

In the first attempt (``TORCHELASTIC_RESTART_COUNT`` 0) rank 1 SIGKILLs itself at the start
of step 3 while rank 0 spends 40 s in that step (longer than any launcher's grace before
SIGKILL) and then writes ``rank0-finished-its-step``; a restarted attempt trains normally.
The batches carry each sample's index last, as tests/plugins/elastic/elastic_faults.py
records them.
"""

from __future__ import annotations

import os
import signal
import time

import torch
from torch import nn

import distrun


class MidStep(distrun.Task):
    def configure_model(self) -> nn.Module:
        return nn.Linear(4, 1)

    def configure_optimizer(self, params):
        return torch.optim.SGD(params, lr=0.1)

    def train_data(self):
        gen = torch.Generator().manual_seed(0)
        return torch.utils.data.TensorDataset(torch.randn(64, 4, generator=gen),
                                              torch.randn(64, 1, generator=gen),
                                              torch.arange(64))

    def training_step(self, model, batch):
        x, y, _ = batch
        if self.global_step == 2 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            if os.environ["RANK"] == "1":
                os.kill(os.getpid(), signal.SIGKILL)
            end = time.monotonic() + 40
            while time.monotonic() < end:
                time.sleep(0.05)
            open("rank0-finished-its-step", "w").close()
        return nn.functional.mse_loss(model(x), y)
