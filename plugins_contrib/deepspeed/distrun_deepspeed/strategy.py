"""``DeepSpeedStrategy``: the task's model and optimizer run by a DeepSpeed engine (ZeRO 1-3).

distrun builds the model and the task's optimizer as usual; once both exist, the
strategy hands them to ``deepspeed.initialize`` (over the process group distrun already
set up, gloo on CPU) and the loop runs the engine: its forward, ``engine.backward`` and
``engine.step``. Gradient accumulation follows distrun's ``--grad-accum`` (the engine is told
which micro-batch ends a step), clipping is DeepSpeed's own (``gradient_clipping``, from
``--grad-clip``), and a ``--ds-config`` file may override any entry distrun derives.

Checkpoints are distrun's format, so a DeepSpeed run resumes at another world size or in
another strategy: :meth:`DeepSpeedStrategy.unwrap_model` gives the checkpoint plugin whole
weights (under stage 3 gathered from the shards) and ``run.optimizer`` is a
:class:`~distrun_deepspeed.optimizer_view.ZeroOptimizerView`, which reads and writes the
engine's sharded optimizer state per parameter in ``torch.optim``'s format.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, cast

import torch

from distrun.plugin import BaseStrategy, UsageError, join_process_group
from distrun_deepspeed.optimizer_view import FullWeights, ZeroOptimizerView
from distrun_deepspeed.options import DeepSpeedOptions, user_config

if TYPE_CHECKING:
    from distrun.plugin import Run

__all__ = ["DeepSpeedStrategy", "engine_config"]

log = logging.getLogger("distrun")


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def engine_config(config: Any, world_size: int) -> dict[str, Any]:
    """The DeepSpeed config distrun derives from the run's options, ``--ds-config`` on top."""
    opts = DeepSpeedOptions.of(config)
    per_rank = max(1, int(config.batch_size) // world_size)  # --batch-size is global
    derived: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": per_rank,
        "gradient_accumulation_steps": int(config.grad_accum),
        "train_batch_size": per_rank * int(config.grad_accum) * world_size,
        "zero_optimization": {"stage": opts.ds_stage},
        # a task's own torch optimizer (SGD, ...) under ZeRO, as the other strategies take
        # it; DeepSpeed refuses those it has not tested unless told (--ds-config may say no)
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,  # distrun logs the steps
        "wall_clock_breakdown": False,
    }
    if config.grad_clip > 0:
        derived["gradient_clipping"] = float(config.grad_clip)
    given = user_config(config)
    merged = _deep_merge(derived, given)
    if "train_batch_size" not in given:  # keep DeepSpeed's batch identity with the user's values
        merged["train_batch_size"] = (merged["train_micro_batch_size_per_gpu"]
                                      * merged["gradient_accumulation_steps"] * world_size)
    return merged


class DeepSpeedStrategy(BaseStrategy):
    """One process per rank; a DeepSpeed engine with ZeRO stage ``--ds-stage``."""

    name = "deepspeed"

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.engine: Any = None
        self.stage = DeepSpeedOptions.of(config).ds_stage
        self._module: torch.nn.Module | None = None
        self._full: FullWeights | None = None

    def setup(self, run: Any) -> None:
        super().setup(run)
        if self.device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")  # no probing for other devices
        try:
            import deepspeed
        except ImportError as exc:
            raise UsageError(f"--strategy deepspeed needs DeepSpeed ({exc}); install it with "
                             "`pip install distrun-deepspeed`") from None
        # DeepSpeed calls c10d functions torch has renamed; the user cannot act on the warning
        warnings.filterwarnings("ignore", category=FutureWarning,
                                message=r"`torch\.distributed\.\w+` is deprecated")
        logging.getLogger("DeepSpeed").setLevel(
            logging.DEBUG if self.config.debug else logging.WARNING)
        if self.world_size == 1:  # the engine needs a process group, also for one rank
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            self._owns_group = join_process_group(backend=backend) or self._owns_group
        _skip_shm_build()
        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(),
                                   auto_mpi_discovery=False)

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        self._module = model.to(self.device)
        return self._module

    def build_engine(self, run: Run) -> tuple[Any, ZeroOptimizerView]:
        """The engine and the optimizer view the loop and checkpoints use from now on."""
        import deepspeed

        if self._module is None:
            raise RuntimeError("DeepSpeedStrategy.build_engine before wrap_model")
        if getattr(run.task, "automatic_optimization", True) is False:
            raise UsageError(
                f"{type(run.task).__name__} steps its optimizers itself (automatic_optimization "
                "= False), but DeepSpeed's engine runs one model and one optimizer; use "
                "--strategy ddp or fsdp for manual optimization")
        optimizer = run.optimizer
        groups = [list(g["params"]) for g in optimizer.param_groups]
        config = engine_config(self.config, self.world_size)
        engine, _, _, _ = deepspeed.initialize(model=self._module, optimizer=optimizer,
                                               config=config, dist_init_required=False)
        self.engine = engine
        if self.stage == 3:
            self._full = FullWeights(engine.module)
        log.info("deepspeed: ZeRO stage %d over %d ranks (%s)", self.stage, self.world_size,
                 type(engine.optimizer).__name__)
        return engine, ZeroOptimizerView(engine, optimizer, groups)

    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.engine is None or model is not self.engine:
            return model
        if self._full is not None:
            return self._full
        return cast(torch.nn.Module, self.engine.module)

    def weights_changed(self) -> None:
        """Make the engine take weights written into the model (a checkpoint, --init-weights)."""
        if self.engine is None:
            return
        if self._full is not None:
            self._full.write_back()
        self.engine.optimizer.refresh_fp32_params()

    # -- per step ------------------------------------------------------------------------
    def no_sync(self, model: torch.nn.Module) -> AbstractContextManager[Any]:
        return self._inside_accumulation() if self.engine is not None else \
            contextlib.nullcontext()

    @contextlib.contextmanager
    def _inside_accumulation(self) -> Iterator[None]:
        self.engine.set_gradient_accumulation_boundary(False)
        try:
            yield
        finally:
            self.engine.set_gradient_accumulation_boundary(True)

    def backward(self, loss: torch.Tensor) -> None:
        # distrun already divided the loss by --grad-accum
        self.engine.backward(loss, scale_wrt_gas=False)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.engine.step()

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        # DeepSpeed clips inside engine.step (gradient_clipping, set from --grad-clip); the
        # norm it reports is the one of the last step taken.
        norm = self.engine.get_global_grad_norm() if self.engine is not None else None
        return torch.tensor(float("nan") if norm is None else float(norm))

    def teardown(self) -> None:
        if self.engine is not None:
            destroy = getattr(self.engine, "destroy", None)
            if destroy is not None:
                destroy()
            self.engine = None
            _forget_groups()
        super().teardown()


def _skip_shm_build() -> None:
    """Keep DeepSpeed from compiling its shared-memory all-reduce op when it sets up comms.

    On CPU, DeepSpeed's comm backend JIT-builds a C++ op on first use: tens of seconds of
    g++ at the first start on a machine, for an op only its inference all-reduce uses; and a
    start killed during that build leaves torch's build lock behind, on which every later start
    waits forever (seen here). Training goes through the process group distrun set up.
    """
    import deepspeed.comm.torch as ds_torch

    ds_torch.build_shm_op = lambda: None


def _forget_groups() -> None:
    """Drop the process groups DeepSpeed caches in module globals (a clone of the world group
    among them): they die with this run's group, and a later fit in the same process (a
    notebook, a test) would otherwise hand the new engine a destroyed group."""
    from deepspeed.utils import groups

    for name, value in list(vars(groups).items()):
        if name.startswith("_") and name.isupper() and name.endswith("_GROUP"):
            setattr(groups, name, {} if isinstance(value, dict) else None)
