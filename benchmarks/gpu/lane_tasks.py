"""The GPU lane's tasks and models, and the CPU side of its checkpoint cross-check.

- :class:`XcheckTask` (``distrun run ... lane_tasks.py:XcheckTask``): a small GPT-shaped model
  (embedding, two pre-norm MLP blocks, head; odd sizes so two ranks hold uneven shards)
  trained a few steps under fsdp or ddp; its checkpoint is small enough (~100 KB) to keep in
  the repository and load on the CPU machine's 2 gloo ranks (tests/core/test_gpu_lane.py).
- :class:`OomTask`: a model whose activations grow ~64 MB a sample, for ``distrun tune
  batch-size`` to meet a real CUDA out-of-memory error within a few doublings.
- :func:`rank_load_and_compare`: one gloo rank of the cross-check (``run_on_ranks``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import distrun

#: the cross-check model's sizes: vocabulary, width, sequence length (odd: uneven shards)
VOCAB, DIM, SEQ = 33, 18, 8
XCHECK_SAMPLES = 64


class XBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class XcheckModel(nn.Module):
    """Next-token prediction over ``VOCAB`` ids: embedding, 2 blocks, final norm, head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(XBlock(DIM) for _ in range(2))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def xcheck_data() -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (XCHECK_SAMPLES, SEQ + 1), generator=gen)
    return torch.utils.data.TensorDataset(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())


class XcheckTask(distrun.Task):
    """The fsdp/ddp train-and-checkpoint task of the lane."""

    def configure_model(self) -> nn.Module:
        return XcheckModel()

    def configure_optimizer(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-2)

    def train_data(self) -> Any:
        return xcheck_data()

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


class OomModel(nn.Module):
    """Each sample's 64 inputs are spread over ``width`` values and pass ``depth`` layers of
    scale-and-tanh: ``depth`` saved activations of ``width`` floats per sample."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.spread = nn.Parameter(torch.randn(width) * 0.01)
        self.scales = nn.Parameter(torch.ones(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.mean(dim=1, keepdim=True) * self.spread
        for i in range(self.scales.numel()):
            h = torch.tanh(h * self.scales[i])
        return h.mean(dim=1)


class OomTask(distrun.Task):
    """For ``distrun tune batch-size``. On CUDA, ``GPU_LANE_TUNE_FRACTION`` (default 0.1; 0:
    the whole device) caps this process's share of the device with
    ``torch.cuda.set_per_process_memory_fraction``, so the caching allocator raises its real
    ``torch.OutOfMemoryError`` after ~14 GB rather than after 141 GB of allocations."""

    def __init__(self) -> None:
        self.width = int(os.environ.get("GPU_LANE_TUNE_WIDTH", str(1 << 21)))
        self.depth = int(os.environ.get("GPU_LANE_TUNE_DEPTH", "4"))

    def configure_model(self) -> nn.Module:
        fraction = float(os.environ.get("GPU_LANE_TUNE_FRACTION", "0.1"))
        if torch.cuda.is_available() and fraction > 0:
            torch.cuda.set_per_process_memory_fraction(fraction)
        return OomModel(self.width, self.depth)

    def configure_optimizer(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=1e-3)

    def train_data(self) -> Any:
        gen = torch.Generator().manual_seed(0)
        return torch.utils.data.TensorDataset(torch.randn(4096, 64, generator=gen),
                                              torch.randn(4096, generator=gen))

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(model(x), y)


# -- the cross-check's CPU side ---------------------------------------------------------------


def full_state(model: nn.Module, optimizer: Any) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor as a full CPU tensor: ``model/<name>``,
    ``optim/<param name>/<key>`` (what the lane records and the cross-check compares)."""

    def full(t: torch.Tensor) -> torch.Tensor:
        if hasattr(t, "full_tensor"):
            # on a 1-rank mesh the local shard is the whole tensor: no collective needed
            t = t.to_local() if t.device_mesh.size() == 1 else t.full_tensor()
        return t.detach().to("cpu", copy=True).contiguous()

    out = {f"model/{k}": full(v) for k, v in model.state_dict().items()}
    if optimizer is not None:
        names = {id(p): n for n, p in model.named_parameters()}
        for p, state in optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    out[f"optim/{names[id(p)]}/{key}"] = full(value)
    return out


def build_layout(layout: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The cross-check model in ``layout`` (``plain``: a replica per rank, DDP's; ``fsdp``:
    FSDP2 over all ranks, each block and the root) on the CPU, seeded apart from the run."""
    torch.manual_seed(1234)
    model = XcheckModel()
    if layout == "fsdp":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def rank_load_and_compare(rank: int, world: int, checkpoint: str, expected: str,
                          layout: str) -> list[str]:
    """Load ``checkpoint`` into a fresh ``layout`` model and its AdamW on this rank; the names
    whose full tensors differ from ``expected`` (a safetensors file) in value or dtype."""
    from safetensors.torch import load_file

    from distrun_safetensors.load import load

    model, optimizer = build_layout(layout)
    if load(checkpoint, model, optimizer) is None:
        return [f"nothing loaded from {checkpoint}"]
    got = full_state(model, optimizer)
    want = load_file(expected)
    bad = sorted(set(want) ^ set(got))
    bad += [k for k in sorted(set(want) & set(got))
            if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    return bad
