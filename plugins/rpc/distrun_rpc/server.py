"""The parameter server: its state and the functions trainers call on it over RPC.

One :class:`ServerState` per server process (``install`` sets it). RPC pickles functions by
their qualified name, so every function trainers call lives at module level here.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import nn

__all__ = ["OptimizerFactory", "ServerState", "install", "install_trainer_optimizer",
           "optim_state_by_name",
           "optim_state_from_names"]

_STATE: ServerState | None = None


class ServerState:
    """This server's shard of parameters (or remote module), its optimizer and its trainers.

    ``update_batch`` is how many pushed gradients an asynchronous update averages; fewer are
    enough once fewer trainers are still training (each waits for its own push's answer).
    """

    def __init__(self, index: int, trainers: int, update_batch: int = 1) -> None:
        self.index = index
        self.names: list[str] = []
        self.params: list[nn.Parameter] = []
        self.module: nn.Module | None = None
        self.module_rref: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.update_batch = max(1, update_batch)
        self.active = trainers
        self.failed: list[str] = []
        self.updates = 0
        self.pushes = 0
        self.done = threading.Event()
        self.lock = threading.Lock()
        self._pending: list[tuple[torch.futures.Future, list[torch.Tensor | None]]] = []

    # -- asynchronous updates: batched, applied when enough pushes wait --------------------
    def push(self, grads: list[torch.Tensor | None]) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        with self.lock:
            self.pushes += 1
            self._pending.append((fut, grads))
            ready = self._take_ready()
        self._answer(ready)
        return fut

    def _take_ready(self) -> list[tuple[torch.futures.Future, list[torch.Tensor | None]]]:
        # Called with the lock held; applies the update of a full batch and hands it back.
        if not self._pending or len(self._pending) < min(self.update_batch, max(self.active, 1)):
            return []
        batch, self._pending = self._pending, []
        n = float(len(batch))
        for i, param in enumerate(self.params):
            grads = [g[i] for _, g in batch if g[i] is not None]
            param.grad = torch.stack(grads).sum(0).div_(n) if grads else None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.updates += 1
        return batch

    def _answer(self, batch: list[tuple[torch.futures.Future, Any]]) -> None:
        if batch:
            fresh = self.values()
            for fut, _ in batch:
                fut.set_result(fresh)

    def trainer_done(self, trainer: str, failed: bool) -> None:
        with self.lock:
            self.active -= 1
            if failed:
                self.failed.append(trainer)
            ready = self._take_ready()
            if self.active <= 0 or failed:
                self.done.set()
        self._answer(ready)

    # -- state -----------------------------------------------------------------------------
    def values(self) -> list[torch.Tensor]:
        with torch.no_grad():
            return [p.detach().clone() for p in self.params]

    def state_dict(self) -> dict[str, Any]:
        with self.lock:
            state: dict[str, Any] = {}
            if self.params:
                state["params"] = dict(zip(self.names, self.values()))
            if self.module is not None:
                state["module"] = {k: v.detach().clone()
                                   for k, v in self.module.state_dict().items()}
            if self.optimizer is not None:
                state["optimizer"] = optim_state_by_name(self.optimizer, self.named_params())
            return state

    def named_params(self) -> list[tuple[str, nn.Parameter]]:
        if self.module is not None:
            return list(self.module.named_parameters())
        return list(zip(self.names, self.params))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        with self.lock, torch.no_grad():
            params = state.get("params", {})
            missing = [n for n in self.names if n not in params]
            if missing:
                raise RuntimeError(f"parameter server {self.index}: the checkpoint lacks "
                                   f"{', '.join(missing)}")
            for name, param in zip(self.names, self.params):
                if name in params:
                    param.copy_(params[name])
            if self.module is not None and "module" in state:
                self.module.load_state_dict(dict(state["module"]))
            if self.optimizer is not None and "optimizer" in state:
                self.optimizer.load_state_dict(optim_state_from_names(
                    self.optimizer, self.named_params(), state["optimizer"]))


def install(state: ServerState | None) -> None:
    global _STATE
    _STATE = state


def _state() -> ServerState:
    if _STATE is None:
        raise RuntimeError("this process is not a distrun parameter server")
    return _STATE


# -- what trainers call ------------------------------------------------------------------------


def pull() -> list[torch.Tensor]:
    """Views of the shard's parameters: inside a distributed autograd context the reply is
    recorded, so the trainer's backward reaches them here (a bare leaf would not be)."""
    return [p.view_as(p) for p in _state().params]


def pull_values() -> list[torch.Tensor]:
    """A detached copy of the shard (async trainers, checkpoints)."""
    return _state().values()


def param_rrefs() -> list[Any]:
    return [rpc.RRef(p) for p in _state().params]


def module_rref() -> Any:
    """An RRef to the remote module (made here, on first ask: RRefs need RPC running)."""
    st = _state()
    with st.lock:
        if st.module_rref is None:
            st.module_rref = rpc.RRef(st.module)
        return st.module_rref


@rpc.functions.async_execution
def push_grads(grads: list[torch.Tensor | None]) -> torch.futures.Future:
    """Queue a trainer's gradients; the answer (fresh parameters) comes after the batch's update."""
    return _state().push(grads)


def trainer_done(trainer: str, failed: bool = False) -> None:
    _state().trainer_done(trainer, failed)


def state_dict() -> dict[str, Any]:
    return _state().state_dict()


def load_state_dict(state: Mapping[str, Any]) -> None:
    _state().load_state_dict(state)


def stats() -> dict[str, int]:
    st = _state()
    return {"updates": st.updates, "pushes": st.pushes}


class OptimizerFactory:
    """The ``optimizer_class`` trainers hand to DistributedOptimizer.

    On a server it returns the server's own optimizer (built from the task, shared by every
    trainer, so its state is one and checkpointable); on a trainer (RPC + DDP's dense part) the
    trainer's ``run.optimizer`` installed with :func:`install_trainer_optimizer`, so the loop
    and checkpoints see the optimizer that really steps. torch's ``_LocalOptimizer`` sets the
    gradients from the step's context and serialises steps with a lock. Being no torch
    optimizer class, it also keeps DistributedOptimizer off its deprecated TorchScript path.
    """

    def __init__(self, cls: type, kwargs: Mapping[str, Any]) -> None:
        self.cls = cls
        self.kwargs = dict(kwargs)

    def __call__(self, params: list[torch.Tensor]) -> Any:
        st = _STATE
        if st is not None and st.optimizer is not None:
            return _Stepper(st.optimizer, st.lock, st)
        if _TRAINER_OPTIMIZER is not None:
            return _Stepper(_TRAINER_OPTIMIZER, threading.Lock(), None)
        return self.cls(params, **self.kwargs)


class _Stepper:
    def __init__(self, optimizer: torch.optim.Optimizer, lock: Any,
                 counter: ServerState | None) -> None:
        self.optimizer, self.lock, self.counter = optimizer, lock, counter

    def step(self) -> None:
        with self.lock:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if self.counter is not None:
                self.counter.updates += 1


_TRAINER_OPTIMIZER: torch.optim.Optimizer | None = None


def install_trainer_optimizer(optimizer: torch.optim.Optimizer | None) -> None:
    """The optimizer DistributedOptimizer steps for this trainer's own parameters."""
    global _TRAINER_OPTIMIZER
    _TRAINER_OPTIMIZER = optimizer


# -- optimizer state keyed by parameter name: JSON-able and independent of the shard layout -----


def optim_state_by_name(optimizer: torch.optim.Optimizer,
                        named: list[tuple[str, nn.Parameter]]) -> dict[str, Any]:
    """``{"state": {param name: {key: tensor}}, "hyper": [group settings]}``."""
    names = {id(p): n for n, p in named}
    sd = optimizer.state_dict()
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    state = {order[int(i)]: {k: t.detach().clone() if isinstance(t, torch.Tensor) else t
                             for k, t in v.items()}
             for i, v in sd["state"].items()}
    hyper = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items() if k != "params"}
             for g in sd["param_groups"]]
    return {"state": state, "hyper": hyper}


def optim_state_from_names(optimizer: torch.optim.Optimizer,
                           named: list[tuple[str, nn.Parameter]],
                           plain: Mapping[str, Any]) -> dict[str, Any]:
    """The ``optimizer.state_dict()`` that puts back what :func:`optim_state_by_name` saved
    for this optimizer's parameters (the saved groups' settings apply in order)."""
    names = {id(p): n for n, p in named}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    saved = plain.get("state", {})
    state = {i: dict(saved[name]) for i, name in enumerate(order) if name in saved}
    current = optimizer.state_dict()["param_groups"]
    hyper = list(plain.get("hyper") or [{}])
    groups = []
    for g, group in enumerate(current):
        settings = dict(hyper[min(g, len(hyper) - 1)])
        if "betas" in settings:
            settings["betas"] = tuple(settings["betas"])
        groups.append({**group, **settings, "params": group["params"]})
    return {"state": state, "param_groups": groups}
