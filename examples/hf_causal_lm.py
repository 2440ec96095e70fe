"""A Hugging Face ``transformers`` causal LM, built from a local config (no download), trained
by distrun and saved as a folder ``AutoModelForCausalLM.from_pretrained`` loads.

    pip install transformers
    distrun run --nproc-per-node 2 --strategy ddp  examples/hf_causal_lm.py --save out/llama
    distrun run --nproc-per-node 2 --strategy fsdp examples/hf_causal_lm.py --model gpt2 --save out/gpt2
    distrun run --nproc-per-node 2 --strategy tp   examples/hf_causal_lm.py --save out/llama-tp
    distrun run --nproc-per-node 2 --strategy pp   examples/hf_causal_lm.py --save out/llama-pp
    distrun run --nproc-per-node 2 --strategy pp   examples/hf_causal_lm.py --model gpt2 --save out/gpt2-pp
    # start from a saved folder, under any strategy:
    distrun run --nproc-per-node 2 --strategy fsdp --init-weights out/llama examples/hf_causal_lm.py

The model is a 4-layer Llama (or GPT-2, whose output head is tied to its token embedding)
with a vocabulary of 64, made with ``AutoModelForCausalLM.from_config``. The data are
sequences of a fixed rule (each token is ``3 * previous + 1`` modulo the vocabulary, from a
random start), so the loss falls from ln(64) ~ 4.2 quickly. The loss is computed from the
logits by the task (transformers' own ``ForCausalLMLoss``, what the model computes when given
``labels=``), so that it is the same under ``--strategy pp``, whose last stage hands the task
the logits. ``--save FOLDER`` writes ``config.json`` and the weights after the fit: the ranks
gather the full state dict (FSDP's shards included) onto rank 0's CPU, which calls
``save_pretrained``; a tied weight is written once, under its first name, as transformers
writes it. Under pp each stage writes the tensors it holds as one shard of a sharded folder
(``model-0000N-of-0000M.safetensors`` and the ``model.safetensors.index.json`` naming them):
nothing is gathered. ``--init-weights FOLDER`` (distrun-safetensors) reads such a folder into
any strategy, each rank only what it holds. Under ``--strategy tp`` the Llama is split by
transformers' own plan (``base_model_tp_plan``; see ``parallelize_plan``); under ``pp`` at its
``model.layers`` (distrun-pipeline's automatic split: the embedding in the first stage, the
norm and ``lm_head`` in the last; the rotary embedding, which holds no state, in every stage).
GPT-2 too: its ``lm_head``, tied to the token embedding, is held by the first and the last
stage, whose gradients of it are summed before each step; the folder holds it once.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
from torch import nn

import distrun

VOCAB, SEQ = 64, 32


def make_config(kind: str) -> Any:
    """A small config of ``kind`` (``llama`` or ``gpt2``), made here: nothing is downloaded."""
    from transformers import GPT2Config, LlamaConfig

    if kind == "llama":
        return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=SEQ, tie_word_embeddings=False)
    if kind == "gpt2":
        return GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=4, n_head=4, n_positions=SEQ,
                          tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)
    raise ValueError(f"--model {kind}: choose llama or gpt2")


class RuleSequences(torch.utils.data.Dataset):
    """``n`` sequences of ``SEQ`` tokens: t[i+1] = (3 t[i] + 1) mod VOCAB from a random start."""

    def __init__(self, n: int, seed: int) -> None:
        starts = torch.randint(VOCAB, (n,), generator=torch.Generator().manual_seed(seed))
        rows = [starts]
        for _ in range(SEQ - 1):
            rows.append((3 * rows[-1] + 1) % VOCAB)
        self.ids = torch.stack(rows, dim=1)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class CausalLMTask(distrun.Task):
    def __init__(self, kind: str = "llama", lr: float = 3e-3) -> None:
        self.kind, self.lr = kind, lr

    def configure_model(self) -> nn.Module:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(make_config(self.kind))

    def parallelize_plan(self, mesh: Any) -> dict[str, Any] | None:
        """Under ``--strategy tp``: transformers' own plan for the model (``base_model_tp_plan``
        of its config, ``layers.*.self_attn.q_proj: colwise``...), spelled out per layer for
        torch's ``parallelize_module``. GPT-2 has none (its Conv1D layers are no Linear)."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        config = make_config(self.kind)
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        hf_plan = getattr(config, "base_model_tp_plan", None)
        if not hf_plan:
            return None  # the tp plugin's automatic plan (or its one-line error)
        plan = {}
        for pattern, style in hf_plan.items():
            if style not in styles:
                raise ValueError(f"{pattern}: transformers' style {style!r} has no torch "
                                 "equivalent here")
            for layer in range(config.num_hidden_layers):  # the base model is `model`
                plan["model." + pattern.replace("*", str(layer))] = styles[style]()
        return plan

    def configure_optimizer(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=0.0)

    def train_data(self) -> Any:
        return RuleSequences(512, seed=0)

    def val_data(self) -> Any:
        return RuleSequences(64, seed=1)

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return next_token_loss(model(input_ids=batch["input_ids"]).logits, batch["labels"])

    def validation_step(self, model: nn.Module, batch: Any) -> Any:
        return {"loss": next_token_loss(model(input_ids=batch["input_ids"]).logits,
                                        batch["labels"])}


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The causal LM loss of ``logits``: the function the model itself applies to ``labels=``
    (so ``model(**batch).loss`` is the same number), called here, where pp's last stage, which
    sees the logits and not the labels, can call it too."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(logits, labels, vocab_size=VOCAB)


def save_pretrained(run: Any, folder: str) -> None:
    """``folder`` as ``save_pretrained`` writes it, from the run's model under any strategy
    (every rank calls this: FSDP gathers the shards onto rank 0)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model = run.unwrapped_model()
    if run.strategy.name in ("pp", "pp+ddp", "pp+fsdp"):
        save_stages(run, model, folder)
        return
    full = get_model_state_dict(model, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))
    # A tied parameter (GPT-2's lm_head is its token embedding) is written once, under its
    # first name, as transformers writes it; from_pretrained ties the other name back.
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(param), name) != name:
            full.pop(name, None)
    if run.is_global_zero:
        model.save_pretrained(folder, state_dict=full)
    run.strategy.barrier()


def save_stages(run: Any, model: nn.Module, folder: str) -> None:
    """Under a pipeline strategy: each stage writes the tensors it holds as one shard of the
    sharded layout ``save_pretrained`` writes, and rank 0 the index and ``config.json``.

    A rank's model has every name; another stage's tensors are placeholders (DTensors on a mesh
    without this rank), its own are DTensors on the mesh of the ranks holding them, of which
    the first writes them (after FSDP's shards are gathered)."""
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    first: dict[int, str] = {}
    tied = {name for name, p in model.named_parameters(remove_duplicate=False)
            if first.setdefault(id(p), name) != name}
    mine: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if isinstance(t, DTensor):
            coordinate = t.device_mesh.get_coordinate()
            if coordinate is None:  # another stage's
                continue
            t = t.full_tensor()  # (FSDP's shards: a collective of the stage's ranks)
            if any(coordinate):  # the first of the ranks holding it writes it
                continue
        if name not in tied:
            mine[name] = t.detach().cpu().contiguous()
    shards: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(shards, {k: v.nbytes for k, v in mine.items()})
    writers = [rank for rank, names in enumerate(shards) if names]
    os.makedirs(folder, exist_ok=True)
    files = {rank: f"model-{i + 1:05d}-of-{len(writers):05d}.safetensors"
             for i, rank in enumerate(writers)}
    if dist.get_rank() in files:
        save_file(mine, os.path.join(folder, files[dist.get_rank()]), metadata={"format": "pt"})
    if run.is_global_zero:
        weight_map = {name: files[rank] for rank in writers for name in shards[rank]}
        total = sum(size for rank in writers for size in shards[rank].values())
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as fh:
            json.dump({"metadata": {"total_size": total},
                       "weight_map": dict(sorted(weight_map.items()))}, fh, indent=2)
        model.config.architectures = [type(model).__name__]
        model.config.save_pretrained(folder)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(folder)
    run.strategy.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama", choices=("llama", "gpt2"))
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--save", default="", help="write a Hugging Face folder there")
    args = parser.parse_args()
    run = distrun.fit(CausalLMTask(args.model, args.lr), max_epochs=1, batch_size=16,
                      log_every_n_steps=8)
    if args.save:
        save_pretrained(run, args.save)
    if run.is_global_zero:
        print(f"validation loss: {run.metrics.get('val_loss', float('nan')):.3f}")
        if args.save:
            print(f"saved {os.path.abspath(args.save)}: "
                  "AutoModelForCausalLM.from_pretrained() loads it")


if __name__ == "__main__":
    main()
