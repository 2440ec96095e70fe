"""Tasks and rank functions of the pipeline tests: the example's tiny GPT and a Sequential."""

from __future__ import annotations

import importlib.util
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

import distrun
from distrun.testing import only_plugins

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny_gpt.py"
PLUGINS = "distrun_pipeline.plugin"


def load_tiny_gpt() -> Any:
    """The examples/tiny_gpt.py module (imported by path, as `distrun run` would)."""
    spec = importlib.util.spec_from_file_location("tiny_gpt_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


class SeqTask(distrun.Task):
    """An ``nn.Sequential`` regression (split without any declaration)."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(384, 8, generator=gen)
        self.data = torch.utils.data.TensorDataset(x, torch.sin(x.sum(dim=1, keepdim=True)))

    def configure_model(self) -> nn.Module:
        layers: list[nn.Module] = [nn.Linear(8, 32)]
        for _ in range(6):
            layers += [nn.Tanh(), nn.Linear(32, 32)]
        return nn.Sequential(*layers, nn.Tanh(), nn.Linear(32, 1))

    def configure_optimizer(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)

    def train_data(self) -> Any:
        return self.data

    def val_data(self) -> Any:
        return torch.utils.data.Subset(self.data, range(40))

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(model(x), y)

    def validation_step(self, model: nn.Module, batch: Any) -> Any:
        x, y = batch
        return {"loss": nn.functional.mse_loss(model(x), y)}


class Flat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class NoSplitTask(SeqTask):
    def configure_model(self) -> nn.Module:
        return Flat()


class Batches:
    """A plain iterable of ready batches (not a dataset: the loop uses it as it is)."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __iter__(self) -> Any:
        return iter(self.items)


class UnevenTask(SeqTask):
    """Its own per-rank batches (no sampler): data-parallel rank 0 has 6, rank 1 has 4. Under a
    pp x dp mesh with dp 2, rank r is data-parallel rank r % 2 (stages are the outer dimension),
    so both stages of one pipeline read the same batches."""

    def train_data(self) -> Any:
        x, y = self.data.tensors
        dp_rank = int(os.environ.get("RANK", "0")) % 2
        return Batches([(x[i * 8:(i + 1) * 8], y[i * 8:(i + 1) * 8])
                        for i in range(6 - 2 * dp_rank)])

    def val_data(self) -> Any:
        return None


class _Rotary(nn.Module):
    """No state but a non-persistent buffer, as a transformers rotary embedding."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 100 ** (torch.arange(0, dim, 2) / dim),
                             persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        angles = positions[:, None].to(x.dtype) * self.inv_freq[None]
        return torch.cat([angles.sin(), angles.cos()], dim=-1)


class _Layer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.lin(h + pos))


class _Decoder(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(_Layer(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.rotary_emb = _Rotary(dim)  # registered after the layers, called before them


class DecoderLM(nn.Module):
    """Shaped like a transformers causal LM: ``model.{embed_tokens, layers, norm, rotary_emb}``
    and ``lm_head``; positions come from the embedding's shape, the rotary embedding is called
    before the layers, and the output is a mapping with the logits and a non-tensor (a cache).
    ``tied``: the head is the token embedding and the logits are shaped by the input's shape,
    as GPT-2's."""

    def __init__(self, vocab: int = 16, dim: int = 16, layers: int = 4,
                 tied: bool = False) -> None:
        super().__init__()
        self.model = _Decoder(vocab, dim, layers)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor) -> dict[str, Any]:
        batch, length = input_ids.shape  # the batch's own input, on every stage
        h = self.model.embed_tokens(input_ids)
        pos = self.model.rotary_emb(h, torch.arange(h.shape[1], device=h.device))
        for layer in self.model.layers:
            h = layer(h, pos)
        logits = self.lm_head(self.model.norm(h))
        return {"logits": logits.view(batch, length, -1), "cache": object()}


class DecoderTask(SeqTask):
    """Next-token prediction with transformers-style batches ``{"input_ids", "labels"}``."""

    tied = False

    def __init__(self) -> None:
        starts = torch.randint(16, (256,), generator=torch.Generator().manual_seed(0))
        rows = [starts]
        for _ in range(11):
            rows.append((5 * rows[-1] + 3) % 16)
        self.ids = torch.stack(rows, dim=1)

    def configure_model(self) -> nn.Module:
        return DecoderLM(tied=self.tied)

    def train_data(self) -> Any:
        return [{"input_ids": row[:-1], "labels": row[1:]} for row in self.ids]

    def val_data(self) -> Any:
        return self.train_data()[:32]

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        logits = model(batch["input_ids"])["logits"]
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def validation_step(self, model: nn.Module, batch: Any) -> Any:
        return {"loss": self.training_step(model, batch)}


def make_task(name: str) -> Any:
    """``seq``, ``nosplit``, ``uneven``, ``decoder`` (shaped like a transformers causal LM) or
    ``gpt``: the example's tiny GPT (4 blocks, small, SGD).

    SGD for weight parity: Adam divides by the gradient's magnitude, so a gradient that is zero
    up to rounding (an unused embedding row) turns a 1e-9 difference into a full step.
    """
    if name == "seq":
        return SeqTask()
    if name == "nosplit":
        return NoSplitTask()
    if name == "uneven":
        return UnevenTask()
    if name == "decoder":
        return DecoderTask()
    if name == "decoder-tied":
        task = DecoderTask()
        task.tied = True
        return task
    os.environ.setdefault("TINY_GPT_CHARS", "6000")
    os.environ.setdefault("TINY_GPT_DIM", "32")
    os.environ.setdefault("TINY_GPT_LAYERS", "4")
    module = load_tiny_gpt()
    if name == "gpt-adam":
        return module.TinyGPTTask()

    class SGDTinyGPT(module.TinyGPTTask):
        def configure_optimizer(self, params: Any) -> torch.optim.Optimizer:
            return torch.optim.SGD(params, lr=0.3, momentum=0.9)

    return SGDTinyGPT()


def owned_state(model: nn.Module) -> dict[str, list[Any]]:
    """The tensors this rank holds, by global name, as nested lists (placeholders left out)."""
    from torch.distributed.tensor import DTensor, Replicate

    out = {}
    for key, value in model.state_dict().items():
        if isinstance(value, DTensor):
            if value.device_mesh.get_coordinate() is None:
                continue  # another stage's
            if all(isinstance(p, Replicate) for p in value.placements):
                value = value.to_local()
            else:
                value = value.full_tensor()  # FSDP shards: a collective of the dp group
        out[key] = value.detach().double().tolist()
    return out


class Recorder:
    """The reduced loss of every logged step, validation metrics and the final weights."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.val: list[float] = []
        self.final: dict[str, Any] = {}

    @distrun.hookimpl
    def distrun_log_metrics(self, run: Any, step: int, metrics: Any) -> None:
        if "loss" in metrics:
            self.losses.append(metrics["loss"])
        if "val_loss" in metrics:
            self.val.append(metrics["val_loss"])

    @distrun.hookimpl
    def distrun_on_fit_end(self, run: Any) -> None:
        self.final = owned_state(run.unwrapped_model())

    @distrun.hookimpl
    def distrun_on_validation_end(self, run: Any, step: int, metrics: Any) -> None:
        if getattr(run, "stage", "fit") != "fit":  # an evaluation session: what it loaded
            self.final = owned_state(run.unwrapped_model())


class Killer:
    """Ends the process abruptly after optimizer step ``at`` (a crash, not a stop)."""

    def __init__(self, at: int) -> None:
        self.at = at

    @distrun.hookimpl
    def distrun_on_step_end(self, run: Any, step: int, metrics: Any) -> None:
        if step == self.at:
            os._exit(17)


def train(rank: int, world: int, task: str, options: dict[str, Any]) -> dict[str, Any]:
    """Train ``task`` with ``options`` on this rank; losses, owned weights, data view."""
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    os.environ.pop("DISTRUN_CONFIG", None)
    if "port" in options:
        os.environ["MASTER_PORT"] = str(options.pop("port"))
    only_plugins(options.pop("plugins", PLUGINS))  # fresh: no earlier fit's plugins
    rec = Recorder()
    extra: tuple[Any, ...] = (Killer(options.pop("kill_at")),) if "kill_at" in options else ()
    opts = dict(max_steps=20, max_epochs=5, batch_size=16, log_every_n_steps=1, summary=False,
                timeout=120.0)
    opts.update(options)
    run = distrun.Trainer(plugins=(rec, *extra), **opts).fit(make_task(task))
    return {"losses": rec.losses, "val": rec.val, "state": rec.final,
            "dp": (run.strategy.dp_rank, run.strategy.dp_world_size)}


def train_many(rank: int, world: int, runs: list[tuple[str, dict[str, Any]]]
               ) -> list[dict[str, Any]]:
    """Several (task, options) fits in this process (a fresh torch costs more than a fit)."""
    return [train(rank, world, task, dict(options)) for task, options in runs]


def reference(task: str, options: dict[str, Any]) -> dict[str, Any]:
    """The same training in this process with the core's single strategy (env restored)."""
    saved = dict(os.environ)
    try:
        return train(0, 1, task, {"plugins": "", **options, "strategy": "single"})
    finally:
        os.environ.clear()
        os.environ.update(saved)


def merged(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The weights of all ranks in one dict (each name must come out equal where repeated)."""
    out: dict[str, Any] = {}
    for result in per_rank:
        out.update(result["state"])
    return out


def max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    assert set(a) == set(b), (sorted(set(a) ^ set(b)))[:5]
    return max((torch.tensor(a[k]) - torch.tensor(b[k])).abs().max().item() for k in a)
