"""What a trainer's ``run.model`` is under ``--strategy rpc``, and its optimizer stand-in."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

__all__ = ["HybridModel", "RemoteOptimizer", "RemotePart", "ServerParamsModel", "optimizer_spec"]



class ParamSource(Protocol):
    """What the models need of the RPC strategy: pulled parameters and the step's context."""

    def pull_params(self, autograd: bool) -> dict[str, torch.Tensor]: ...

    def open_context(self) -> int: ...

class ServerParamsModel(nn.Module):
    """The user's model with its parameters on the servers (synchronous parameter server).

    Each forward pulls the parameters from their servers and runs the local module on them
    (``torch.func.functional_call``). In training mode the pull happens inside the step's
    distributed autograd context, so backward sends the gradients to the servers. Buffers stay
    local. ``module`` keeps the parameters of the last pull (what a checkpoint of it sees).
    """

    def __init__(self, module: nn.Module, strategy: ParamSource) -> None:
        super().__init__()
        self.module = module
        self._strategy = strategy

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        training = self.training and torch.is_grad_enabled()
        params = self._strategy.pull_params(autograd=training)
        if training:  # keep the local copy current for checkpoints and evaluation after fit
            with torch.no_grad():
                local = dict(self.module.named_parameters())
                for name, value in params.items():
                    local[name].copy_(value)
        return torch.func.functional_call(self.module, params, args, kwargs)


class HybridModel(nn.Module):
    """RPC + DDP: ``remote`` (a RemoteModule on a server) feeding ``dense`` (DDP over trainers).

    ``model(*inputs)`` is ``dense(remote(*inputs))``; a task's ``training_step`` may also call
    ``model.remote`` and ``model.dense`` itself.
    """

    def __init__(self, remote: nn.Module, dense: nn.Module, strategy: ParamSource) -> None:
        super().__init__()
        # Not a registered child: RemoteModule refuses state_dict(), parameters() and train().
        object.__setattr__(self, "remote", RemotePart(remote))
        self.dense = dense
        self._strategy = strategy

    def forward(self, *inputs: Any) -> Any:
        self.begin()
        return self.dense(self.remote(*inputs))

    def begin(self) -> None:
        """Open the step's distributed autograd context (forward does it; call it first when
        a training_step uses ``model.remote``/``model.dense`` directly)."""
        if self.training and torch.is_grad_enabled():
            self._strategy.open_context()


class RemotePart:
    """Calls a RemoteModule's forward (which is what runs on the server) like a module."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.forward(*args, **kwargs)

    forward = __call__

    def remote_parameters(self) -> list[Any]:
        return self.module.remote_parameters()


class RemoteOptimizer:
    """Stands in for ``run.optimizer``: ``step()`` runs the remote update, the task's own
    optimizer (built over local parameters) only supplies ``param_groups`` and settings."""

    def __init__(self, template: torch.optim.Optimizer, step: Callable[[], None]) -> None:
        self.template = template
        self._step = step

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.template.param_groups

    @property
    def defaults(self) -> dict[str, Any]:
        return self.template.defaults

    @property
    def state(self) -> Any:
        return self.template.state

    def step(self, closure: Any = None) -> None:
        self._step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.template.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.template.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.template.load_state_dict(state)


def optimizer_spec(optimizer: torch.optim.Optimizer) -> tuple[type, dict[str, Any]]:
    """(class, keyword arguments) that rebuild ``optimizer`` over other parameters.

    The arguments are the first group's settings that the class's constructor accepts.
    """
    cls = type(optimizer)
    try:
        accepted = set(inspect.signature(cls.__init__).parameters)
    except (TypeError, ValueError):  # pragma: no cover - C-implemented constructors
        accepted = {"lr"}
    group = optimizer.param_groups[0]
    kwargs = {k: v for k, v in group.items() if k != "params" and k in accepted}
    return cls, kwargs
