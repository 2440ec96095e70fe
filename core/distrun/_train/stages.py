"""Evaluation and prediction: the ``validate``, ``test`` and ``predict`` stages.

Validation runs inside a fit (every ``val_every_n_steps`` and at each epoch end) and as a
stage of its own; test and predict are stages only. Each shards its dataset over the
data-parallel ranks with :class:`~distrun._train.sampler.ShardedEvalSampler`, whose filler
batches (they keep the ranks' forward counts equal) weigh nothing, so:

- a metric is the sample-weighted mean over the whole dataset, every sample counted once,
  summed over ranks in one all-reduce;
- a logged metric object (torchmetrics) is computed over every rank's state at the end of the
  pass, and a filler batch's step leaves its state as it was
  (:func:`~distrun._train.metric_objects.metrics_untouched`);
- predictions carry their dataset indices and come back in dataset order (or are written per
  rank to ``RUN_DIR/predictions`` with their indices, for outputs too large to gather).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from typing import Any

import torch

from distrun._spec.errors import UsageError
from distrun._train.loaders import map_loader
from distrun._train.metric_objects import metrics_untouched
from distrun._train.metrics import Accumulator, LogTarget, logging_to
from distrun._train.run import Run
from distrun._train.sampler import ShardedEvalSampler, is_map_dataset
from distrun._train.tensors import batch_len, to_cpu, to_device

__all__ = ["evaluate", "eval_loader", "predict"]
#: per stage: the task's data method, its step method and the metrics' prefix
_EVAL = {"validate": ("val_data", "validation_step", "val_"),
         "test": ("test_data", "test_step", "test_")}


def eval_loader(run: Run, data: Any) -> Any:
    """A loader over ``data`` for evaluation: a map-style dataset is sharded by the eval
    sampler (one global ``batch_size`` per step, as in training); anything else is used as is
    on every rank (your own sharding)."""
    if data is None or not is_map_dataset(data):
        return data
    cfg, st = run.config, run.strategy
    local = max(1, cfg.batch_size // st.dp_world_size)
    sampler = ShardedEvalSampler(len(data), local, st.dp_rank, st.dp_world_size)
    from distrun._train.datamodule import data_of

    return map_loader(data, sampler, collate_fn=data_of(run, "collate_fn"),
                      num_workers=cfg.num_workers, pin_memory=st.device.type == "cuda")


def _real_sizes(loader: Any) -> list[int] | None:
    sampler = getattr(loader, "batch_sampler", None)
    return sampler.real if isinstance(sampler, ShardedEvalSampler) else None


def _indices(loader: Any) -> list[list[int]] | None:
    sampler = getattr(loader, "batch_sampler", None)
    return sampler.batches if isinstance(sampler, ShardedEvalSampler) else None


def _loader_for(run: Run, stage: str) -> Any:
    if stage == "validate":
        if run.val_loader is None:
            run.val_loader = eval_loader(run, _data(run, "val_data"))
        return run.val_loader
    name = "test_data" if stage == "test" else "predict_data"
    data = _data(run, name)
    if data is None and stage == "predict":
        data = _data(run, "test_data")  # Lightning's habit: predict over the test set
    if data is None:
        raise UsageError(f"--stage {stage}: {type(run.task).__name__} has no {name}() (or it "
                         f"returned None); define {name}() returning a Dataset")
    return eval_loader(run, data)


def _data(run: Run, name: str) -> Any:
    from distrun._train.datamodule import data_of, prepare

    prepare(run)
    return data_of(run, name)


def evaluate(run: Run, stage: str = "validate", limit: int | None = None) -> dict[str, float]:
    """Run ``validation_step`` / ``test_step`` over the stage's data; metrics reduced over
    ranks as sample-weighted means (``val_*`` / ``test_*``). ``limit``: the first batches
    only (default: ``--limit-val-batches`` for validation)."""
    if limit is None:
        limit = run.config.limit_val_batches if stage == "validate" else 0
    data_name, step_name, prefix = _EVAL[stage]
    step_fn = getattr(run.task, step_name, None)
    if step_fn is None and stage == "test":
        raise UsageError(f"--stage test: {type(run.task).__name__} has no test_step(model, "
                         "batch); define it (it returns the loss or a dict of metrics)")
    loader = _loader_for(run, stage)
    if step_fn is None or loader is None:
        return {}
    model, st = run.model, run.strategy
    real = _real_sizes(loader)
    acc = Accumulator()
    target = LogTarget(stage, None, acc)
    was_training = model.training
    model.eval()
    with torch.no_grad(), logging_to(target):
        for i, batch in enumerate(loader):
            if limit and i >= limit:
                break
            batch = to_device(batch, st.device)
            target.weight = float(real[i] if real is not None else batch_len(batch))
            filler = real is not None and real[i] == 0  # its forward runs, nothing counts
            with metrics_untouched(run.task) if filler else contextlib.nullcontext():
                out = step_fn(model, batch)
            if out is None:
                continue
            target.add_many(out if isinstance(out, Mapping) else {"loss": out})
    model.train(was_training)
    return acc.reduce(st, prefix=prefix) if acc else {}


def predict(run: Run) -> Any:
    """Run ``predict_step`` (default: ``model(batch)``, or ``model(batch[0])`` for a tuple or
    list) over the predict data; outputs in dataset order on every rank, or written per rank
    when ``--predictions write``."""
    loader = _loader_for(run, "predict")
    step_fn = getattr(run.task, "predict_step", None) or _default_predict
    model, st = run.model, run.strategy
    real, indices = _real_sizes(loader), _indices(loader)
    outputs: list[Any] = []
    order: list[int] = []
    model.eval()
    with torch.no_grad():
        for i, batch in enumerate(loader):
            if real is not None and real[i] == 0:  # a filler batch: its forward only
                with metrics_untouched(run.task):
                    step_fn(model, to_device(batch, st.device))
                continue
            out = step_fn(model, to_device(batch, st.device))
            outputs.append(to_cpu(out))
            if indices is not None:
                order.extend(indices[i])
    if run.config.predictions == "write":
        return _write(run, outputs, order)
    return _gather(run, outputs, order)


def _default_predict(model: Any, batch: Any) -> Any:
    if isinstance(batch, (list, tuple)):
        return model(batch[0])
    return model(batch)


def _samples(outputs: list[Any]) -> list[Any]:
    """Batch outputs split into per-sample outputs (tensors and dicts of tensors: by the
    first dimension; lists: by item); anything else stays one item per batch."""
    samples: list[Any] = []
    for out in outputs:
        if isinstance(out, torch.Tensor) and out.dim() > 0:
            samples.extend(out.unbind(0))
        elif isinstance(out, Mapping) and out and all(
                isinstance(v, torch.Tensor) and v.dim() > 0 for v in out.values()):
            n = len(next(iter(out.values())))
            samples.extend({k: v[j] for k, v in out.items()} for j in range(n))
        elif isinstance(out, list):
            samples.extend(out)
        else:
            samples.append(out)
    return samples


def _combine(samples: list[Any]) -> Any:
    """Per-sample outputs as one stacked tensor (or dict of them) when they allow it."""
    if samples and all(isinstance(s, torch.Tensor) for s in samples):
        try:
            return torch.stack(samples)
        except RuntimeError:
            return samples
    if samples and all(isinstance(s, Mapping) for s in samples):
        try:
            return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
        except (RuntimeError, KeyError, TypeError):
            return samples
    return samples


def _gather(run: Run, outputs: list[Any], order: list[int]) -> Any:
    samples = _samples(outputs)
    if order and len(order) != len(samples):
        raise UsageError(f"predict_step returned {len(samples)} outputs for {len(order)} samples; "
                         "return one row (first dimension) per sample of the batch")
    mine: list[tuple[Any, Any]] = list(zip(order, samples)) if order else \
        [(None, s) for s in samples]
    if run.world_size > 1 and run.strategy.dp_world_size > 1:
        import torch.distributed as dist

        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        # ranks of one data-parallel replica hold the same predictions: take each index once
        seen: dict[Any, Any] = {}
        merged: list[tuple[Any, Any]] = []
        for part in everyone:
            for index, sample in part:
                if index is None:
                    merged.append((index, sample))
                elif index not in seen:
                    seen[index] = sample
                    merged.append((index, sample))
        mine = merged
    if order:
        mine.sort(key=lambda pair: pair[0])
    return _combine([s for _, s in mine])


def _write(run: Run, outputs: list[Any], order: list[int]) -> str:
    """Each rank's predictions to ``RUN_DIR/predictions/rank-R.safetensors`` (tensors, with
    an ``index`` tensor of dataset positions) or ``rank-R.jsonl`` (anything else)."""
    folder = os.path.join(run.run_dir, "predictions")
    os.makedirs(folder, exist_ok=True)
    samples = _samples(outputs)
    combined = _combine(samples)
    base = os.path.join(folder, f"rank-{run.rank}")
    if isinstance(combined, (torch.Tensor, dict)):
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise UsageError("--predictions write saves tensors as safetensors: pip install "
                             "safetensors (or distrun-safetensors)") from None
        tensors = {"output": combined} if isinstance(combined, torch.Tensor) else \
            {f"output.{k}": v for k, v in combined.items()}
        if order:
            tensors["index"] = torch.tensor(order, dtype=torch.int64)
        save_file({k: v.contiguous() for k, v in tensors.items()}, base + ".safetensors.tmp")
        os.replace(base + ".safetensors.tmp", base + ".safetensors")
    else:
        with open(base + ".jsonl.tmp", "w") as fh:
            for j, sample in enumerate(samples):
                row = {"index": order[j] if order else None, "output": _jsonable(sample)}
                fh.write(json.dumps(row) + "\n")
        os.replace(base + ".jsonl.tmp", base + ".jsonl")
    if run.world_size > 1:
        run.strategy.barrier()
    return folder


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, Mapping):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value
