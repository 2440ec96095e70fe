"""The schedule in the loop: one ``schedule.step`` per training micro-batch, ``schedule.eval``
for validation, and the hooks that put them there.

The core loop calls ``distrun_training_step`` then ``distrun_backward`` per micro-batch. Here
the training step runs the whole pipeline (forward and backward of every pipeline
micro-batch, gradients accumulated) and returns the step's loss, which exists on the last
stage only: it is broadcast over the pipeline group, so every rank logs the same, true value
and the core's reduction (a mean over ranks) stays right. Backward then has nothing left to do.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from distrun.plugin import UsageError, hookimpl
from distrun_pipeline import schedules

__all__ = ["Pipeline", "PipelineHooks"]

_EVAL_STEPS = ("validation_step", "test_step")


class _Returns:
    """A stand-in model for the task's step on the last stage: returns the pipeline output."""

    def __init__(self, output: Any) -> None:
        self.output = output

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.output


#: the keys of a Hugging Face style batch: the model's input and the target
HF_KEYS = ("input_ids", "labels")


def split_batch(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The (model input, target) of a batch: a pair, the first is the model's input; or a
    mapping of exactly ``input_ids`` and ``labels`` (the Hugging Face names)."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2 \
            and all(isinstance(t, torch.Tensor) for t in batch):
        return batch[0], batch[1]
    if isinstance(batch, Mapping) and sorted(batch) == sorted(HF_KEYS) \
            and all(isinstance(batch[k], torch.Tensor) for k in HF_KEYS):
        return batch["input_ids"], batch["labels"]
    got = f"{type(batch).__name__}" + (
        f" of {len(batch)}" if isinstance(batch, (tuple, list)) else
        f" of {', '.join(map(str, batch))}" if isinstance(batch, Mapping) else "")
    raise UsageError("pipeline parallel needs batches that are (input, target) pairs of tensors "
                     "or mappings of exactly input_ids and labels (the first stage reads the "
                     f"input, the last the target); got {got}")


def as_batch(like: Any, output: Any, target: Any) -> Any:
    """A batch of the task's own form with the pipeline's output in the input's place."""
    if isinstance(like, Mapping):
        return {"input_ids": output, "labels": target}
    return (output, target)


class Pipeline:
    """This rank's stages and the torch schedule over them."""

    def __init__(self, strategy: Any, modules: list[nn.Module],
                 stage_ids: list[int], trees: list[Any] | None = None) -> None:
        self.st = strategy
        self.task = strategy.task
        self.modules = modules
        cfg = strategy.config
        self.accum = max(1, int(cfg.grad_accum))
        #: what each micro-batch's loss is divided by: the gradients are then the batch mean's
        self.scale = strategy.microbatches * self.accum
        n = strategy.stages
        self.stages = [PipelineStage(m, s, n, strategy.device, group=strategy.pp_group)
                       for m, s in zip(modules, stage_ids, strict=True)]
        cls, multi = schedules.SCHEDULES[strategy.schedule_name]
        try:
            # scale_grads=False: the loss is divided instead (torch's scaling would also divide
            # the gradients earlier micro-batches of a --grad-accum step left)
            self.schedule = cls(self.stages if multi else self.stages[0],
                                strategy.microbatches, loss_fn=self.loss, scale_grads=False)
        except (ValueError, AssertionError) as exc:
            raise UsageError(f"--pp-schedule {strategy.schedule_name} with {strategy.pp_size} "
                             f"ranks and --microbatches {strategy.microbatches}: {exc}") from None
        self.first = any(s.is_first for s in self.stages)
        self.last = any(s.is_last for s in self.stages)
        #: the last stage's module (unwrapped): gives the output back in the model's own form
        self.last_tree = next((t for t, s in zip(trees or [], self.stages, strict=False)
                               if s.is_last), None)
        #: the form of the training batches (a pair or a mapping), for the task's loss
        self.batch_like: Any = ()
        #: weights tied across stages held here: (parameter, group of its holders, counted)
        self.tied: list[tuple[nn.Parameter, Any, bool]] = []
        # the pp rank holding the last stage: where the loss comes from
        self.last_rank = schedules.placement(strategy.pp_size, strategy.v)[n - 1]
        self._zero = torch.zeros((), device=strategy.device)

    # -- the loss, as the task computes it ------------------------------------------------
    def model_output(self, output: Any) -> Any:
        """The last stage's tensor in the form the model's forward returned it."""
        return self.last_tree.as_model_output(output) if self.last_tree is not None else output

    def loss(self, output: Any, target: Any) -> torch.Tensor:
        """The task's loss of one pipeline micro-batch (on the last stage)."""
        own = getattr(self.task, "pipeline_loss", None)
        output = self.model_output(output)
        if own is not None:
            loss = own(output, target)
        else:
            loss = self.task.training_step(_Returns(output),
                                           as_batch(self.batch_like, output, target))
            if isinstance(loss, Mapping):
                loss = loss["loss"]
        return loss / self.scale

    def sync_tied(self) -> None:
        """Sum the gradients of weights tied across stages over the ranks holding them (each
        stage saw one use of the weight), so every copy takes the same step. Under pp+ddp the
        sum also runs over the data-parallel replicas, which DDP already averaged: divided
        back by their number."""
        for p, group, _ in self.tied:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=group)
            if self.st.dp_world_size > 1:
                p.grad.div_(self.st.dp_world_size)

    def _broadcast(self, t: torch.Tensor) -> torch.Tensor:
        dist.broadcast(t, group=self.st.pp_group, group_src=self.last_rank)
        return t

    def _train_mode(self, mode: bool) -> None:
        for m in self.modules:
            if m.training != mode:
                m.train(mode)

    # -- steps ---------------------------------------------------------------------------
    def train_step(self, batch: Any) -> torch.Tensor:
        x, y = split_batch(batch)
        self.batch_like = batch
        self._train_mode(True)
        losses: list[torch.Tensor] = []
        args = (x,) if self.first else ()
        self.schedule.step(*args, target=y, losses=losses, stage_input=x)
        if self.last:
            loss = torch.stack([t.detach() for t in losses]).float().sum() * self.accum
        else:
            loss = self._zero.clone()
        return self._broadcast(loss)

    def eval_step(self, step_fn: Any, batch: Any) -> Any:
        """The task's ``validation_step``/``test_step`` over the pipeline's output; its values
        are sent from the last stage to the others of its pipeline."""
        x, y = split_batch(batch)
        self.batch_like = batch
        n, full = x.shape[0], self.st.local_batch or x.shape[0]
        if n > full:
            raise UsageError(f"pipeline evaluation batches hold at most the per-rank training "
                             f"batch ({full}); got {n}")
        if n < full:  # the last, short batch: padded to the shapes the stages were built for
            x = torch.cat([x, x[-1:].expand(full - n, *x.shape[1:])])
            y = torch.cat([y, y[-1:].expand(full - n, *y.shape[1:])])
        self._train_mode(False)
        out = self.schedule.eval(*((x,) if self.first else ()), target=y, stage_input=x)
        values: list[Any] = [None]
        if self.last:
            result = step_fn(_Returns(self.model_output(out[:n])), batch)
            if result is not None:
                items = result.items() if isinstance(result, Mapping) else [("loss", result)]
                values[0] = {k: float(v) for k, v in items}
        dist.broadcast_object_list(values, group=self.st.pp_group, group_src=self.last_rank)
        if values[0] is None:
            return None
        return {k: torch.tensor(v, dtype=torch.float64) for k, v in values[0].items()}


class PipelineHooks:
    """Registered for the runs of a pipeline strategy only (``run.add_hooks``)."""

    def __init__(self, strategy: Any) -> None:
        self.st = strategy
        self.patched: list[str] = []

    def _pipe(self) -> Pipeline:
        pipe = self.st.pipeline
        if pipe is None:  # pragma: no cover (the core wraps the model before any step)
            raise RuntimeError("the pipeline is built when the strategy wraps the model")
        return pipe

    @hookimpl(tryfirst=True)
    def distrun_training_step(self, run, batch):
        return self._pipe().train_step(batch)

    @hookimpl(tryfirst=True)
    def distrun_backward(self, run, loss):
        return True  # the schedule's step did it

    @hookimpl(tryfirst=True)
    def distrun_optimizer_step(self, run):
        self._pipe().sync_tied()  # then the core's step (clipping included): returns None

    def patch_eval(self, task: Any) -> None:
        """Route the task's evaluation steps through the schedule (undone at teardown)."""
        for name in _EVAL_STEPS:
            fn = getattr(task, name, None)
            if fn is not None and name not in self.patched:
                setattr(task, name, functools.partial(self._eval, fn))
                self.patched.append(name)

    def _eval(self, fn: Any, model: Any, batch: Any) -> Any:
        return self._pipe().eval_step(fn, batch)

    @hookimpl
    def distrun_teardown(self, run):
        for name in self.patched:
            run.task.__dict__.pop(name, None)
        self.patched.clear()
