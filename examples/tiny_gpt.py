"""A tiny GPT (character level) trained on Python's own source code: no download.

    distrun run examples/tiny_gpt.py                                           # one process
    distrun run --nproc-per-node 2 --strategy ddp  examples/tiny_gpt.py
    distrun run --nproc-per-node 2 --strategy fsdp examples/tiny_gpt.py
    distrun run --nproc-per-node 2 --strategy tp   examples/tiny_gpt.py
    distrun run --nproc-per-node 4 --strategy fsdp --tp-size 2 examples/tiny_gpt.py   # 2D
    TINY_GPT_LAYERS=8 distrun run --nproc-per-node 2 --strategy pp examples/tiny_gpt.py
    TINY_GPT_LAYERS=8 distrun run --nproc-per-node 4 --strategy pp+fsdp --pp 2 examples/tiny_gpt.py

The text is the source of a few standard-library modules (read with ``inspect``), cut into
windows of ``BLOCK`` characters; the model learns to predict the next character. The network
is written the way tensor parallelism wants it: separate q/k/v/out projections and an MLP of
two Linears per block (the tp plugin's automatic plan splits both), reshapes with ``-1`` heads
(each rank holds ``heads / tp`` of them), and an untied output head. The loss starts at about
ln(vocab) ~ 4.5 and drops below 2.5 within a few minutes on a CPU.

Environment knobs (for quick tests): ``TINY_GPT_DIM``, ``TINY_GPT_LAYERS``, ``TINY_GPT_CHARS``.
Pipeline parallelism cuts the ``blocks`` ModuleList into stages (embeddings with the first,
``ln_f`` and ``head`` with the last), so give it as many blocks as stages or more
(``benchmarks/pipeline.py`` uses 8); the forward only reads the input's shape before the first
block, as the pp strategies need.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import distrun

BLOCK = 64
MODULES = ("textwrap", "argparse")


def corpus(max_chars: int = 0) -> str:
    """Source code of a few stdlib modules (always installed with Python)."""
    import importlib

    text = "\n".join(inspect.getsource(importlib.import_module(m)) for m in MODULES)
    return text[:max_chars] if max_chars else text


class CharWindows(torch.utils.data.Dataset):
    """Windows of ``block + 1`` characters every ``stride``: (input, next-character target)."""

    def __init__(self, ids: torch.Tensor, block: int = BLOCK, stride: int = BLOCK // 2) -> None:
        self.ids, self.block, self.stride = ids, block, stride

    def __len__(self) -> int:
        return (len(self.ids) - self.block - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.ids[i * self.stride:i * self.stride + self.block + 1]
        return chunk[:-1], chunk[1:]


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[0], x.shape[1]
        # -1 heads: under tensor parallelism each rank holds heads / tp of them
        q, k, v = (lin(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 4 * dim)
        self.proj = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, dim: int = 64, layers: int = 2, heads: int = 4,
                 block: int = BLOCK) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(block, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _plain(t: Any) -> Any:
    # with --tp-loss-parallel the loss is a (replicated) DTensor; metrics want a plain tensor
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class TinyGPTTask(distrun.Task):
    def __init__(self, lr: float = 3e-3) -> None:
        self.lr = lr
        text = corpus(int(os.environ.get("TINY_GPT_CHARS", "0")))
        self.chars = sorted(set(text))
        ids = torch.tensor([self.chars.index(c) for c in text], dtype=torch.long)
        cut = int(len(ids) * 0.9)
        self.train_set = CharWindows(ids[:cut])
        self.val_set = CharWindows(ids[cut:], stride=BLOCK)

    def configure_model(self) -> nn.Module:
        return TinyGPT(len(self.chars), dim=int(os.environ.get("TINY_GPT_DIM", "64")),
                       layers=int(os.environ.get("TINY_GPT_LAYERS", "2")))

    def configure_optimizer(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=0.0)

    def train_data(self) -> Any:
        return self.train_set

    def val_data(self) -> Any:
        return self.val_set

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def validation_step(self, model: nn.Module, batch: Any) -> Any:
        x, y = batch
        return {"loss": _plain(F.cross_entropy(model(x).flatten(0, 1), y.flatten()))}

    def sample(self, model: nn.Module, prompt: str = "def ", n: int = 80) -> str:
        """Greedy continuation of ``prompt`` (one process, unsharded model)."""
        device = next(model.parameters()).device  # (the GPU's, where the run trained there)
        idx = torch.tensor([[self.chars.index(c) for c in prompt if c in self.chars]],
                           device=device)
        with torch.no_grad():
            for _ in range(n):
                logits = model(idx[:, -BLOCK:])[:, -1]
                idx = torch.cat([idx, logits.argmax(-1, keepdim=True)], dim=1)
        return "".join(self.chars[i] for i in idx[0].tolist())


if __name__ == "__main__":
    task = TinyGPTTask()
    run = distrun.fit(task, max_epochs=2, batch_size=32, log_every_n_steps=20)
    if run.is_global_zero:
        print(f"validation loss: {run.metrics.get('val_loss', float('nan')):.3f}")
        if run.world_size == 1 and run.strategy.name == "single":
            print("sample:", repr(task.sample(run.unwrapped_model())))
