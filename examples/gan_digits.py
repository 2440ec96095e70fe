"""A small GAN on scikit-learn's bundled 8x8 digits: two models, two optimizers, manual steps.

    distrun run examples/gan_digits.py                                 # one process
    distrun run --nproc-per-node 2 examples/gan_digits.py              # ddp on 2 ranks
    distrun run --nproc-per-node 2 --strategy fsdp examples/gan_digits.py
    distrun run --nproc-per-node 2 --ckpt-every-n-steps 20 --resume auto examples/gan_digits.py

The Lightning pattern, ported: ``automatic_optimization = False``, ``configure_optimizers``
returns an optimizer for each model (and a scheduler for each), and ``training_step`` steps
the discriminator, then the generator, with ``self.optimizers()`` and
``self.manual_backward(loss)``. ``configure_model`` returns ``distrun.Models(generator=...,
discriminator=...)``, so the strategy wraps each model on its own (two DDP modules, or two
FSDP roots). ``--grad-clip``, ``--precision bf16-mixed`` and checkpoints (both models, both
optimizers, both schedulers) apply as in any run. Nothing is downloaded: the 1,797 images ship
inside scikit-learn.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

import distrun

LATENT = 16
BATCH_SIZE = 64


def digits_images() -> torch.utils.data.Dataset:
    """The digits as flat 64-pixel rows scaled to [-1, 1] (the generator's tanh range)."""
    from sklearn.datasets import load_digits

    images, _ = load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32) / 8.0 - 1.0
    return torch.utils.data.TensorDataset(x)


def generator() -> nn.Module:
    return nn.Sequential(nn.Linear(LATENT, 128), nn.LeakyReLU(0.2),
                         nn.Linear(128, 128), nn.LeakyReLU(0.2),
                         nn.Linear(128, 64), nn.Tanh())


def discriminator() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.LeakyReLU(0.2), nn.Dropout(0.2),
                         nn.Linear(128, 64), nn.LeakyReLU(0.2),
                         nn.Linear(64, 1))


class GanTask(distrun.Task):
    automatic_optimization = False  # training_step steps both optimizers itself

    def __init__(self, lr: float = 2e-4) -> None:
        self.lr = lr
        self.images = digits_images()

    def configure_model(self) -> nn.Module:
        return distrun.Models(generator=generator(), discriminator=discriminator())

    def configure_optimizers(self, model):
        opt_g = torch.optim.Adam(model.generator.parameters(), lr=self.lr, betas=(0.5, 0.999))
        opt_d = torch.optim.Adam(model.discriminator.parameters(), lr=self.lr,
                                 betas=(0.5, 0.999))
        sched_g = torch.optim.lr_scheduler.ExponentialLR(opt_g, gamma=0.999)
        sched_d = torch.optim.lr_scheduler.ExponentialLR(opt_d, gamma=0.999)
        return [opt_g, opt_d], [sched_g, sched_d]

    def train_data(self):
        return self.images

    def training_step(self, model, batch):
        (real,) = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(real.shape[0], LATENT, device=real.device)
        fake = model.generator(z)

        # the discriminator: real images are 1, generated ones 0
        real_logits = model.discriminator(real)
        fake_logits = model.discriminator(fake.detach())
        d_loss = (F.binary_cross_entropy_with_logits(real_logits, torch.ones_like(real_logits))
                  + F.binary_cross_entropy_with_logits(fake_logits,
                                                       torch.zeros_like(fake_logits))) / 2
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()

        # the generator: make the discriminator say 1
        logits = model.discriminator(fake)
        g_loss = F.binary_cross_entropy_with_logits(logits, torch.ones_like(logits))
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()

        for scheduler in self.lr_schedulers():
            scheduler.step()
        self.log("d_loss", d_loss)
        self.log("g_loss", g_loss)
        self.log("d_real", torch.sigmoid(real_logits).mean())


if __name__ == "__main__":
    run = distrun.fit(GanTask(), max_epochs=int(os.environ.get("EPOCHS", "30")),
                      batch_size=BATCH_SIZE, log_every_n_steps=28)
    if run.is_global_zero:
        print(f"d_loss {run.metrics['d_loss']:.4f} | g_loss {run.metrics['g_loss']:.4f} | "
              f"D(real) {run.metrics['d_real']:.3f}")
