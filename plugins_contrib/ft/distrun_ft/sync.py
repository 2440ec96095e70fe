"""``--ft-sync localsgd:N`` / ``diloco:N``: the groups meet every N steps, not every step.

For slow links between the groups. One quorum per *window* of N steps: its participants and
replica ranks split each step's global batch for the whole window, as in the every-step mode;
inside the window each group trains alone (its strategy still syncs its own ranks) and steps
its optimizer on its share. At the window's end the groups sync over torchft's Manager:

- ``localsgd``: the weights are averaged;
- ``diloco``: the change of the weights over the window (start minus end, the
  pseudo-gradient) is averaged, the weights go back to the window's start and an outer
  optimizer (SGD, lr 0.7, Nesterov momentum 0.9, as the DiLoCo paper) applies it.

The sync commits only if every participant votes so. One that does not (a group died in the
window) puts every survivor back to the window's start (weights, inner optimizer, progress),
and the window is trained again with the next quorum on the same samples: each sample is
still consumed by exactly one committed window. A group that joins heals at a window's start,
where its peers' weights agree. The step hooks (logging, metrics, checkpoints) run at the
syncs, on weights every group shares.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

__all__ = ["Window"]


def _local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``t`` (its shard, a view, under fsdp)."""
    return t.to_local() if hasattr(t, "to_local") else t


class Window:
    """The state a window starts from, and the sync that ends it."""

    def __init__(self, run: Any, mode: str, every: int) -> None:
        self.run, self.mode, self.every = run, mode, every
        self.params = [p for p in run.model.parameters() if p.requires_grad]
        self.outer = torch.optim.SGD(self.params, lr=0.7, momentum=0.9, nesterov=True) \
            if mode == "diloco" else None
        self._weights: list[torch.Tensor] = []
        self._optimizer: dict[str, Any] = {}
        self._progress: dict[str, Any] = {}
        #: what came back of the last committed sync's ``tail``
        self.tail = torch.zeros(0)

    # what a healing group takes from its peer besides the model and the inner optimizer
    def state_dict(self) -> dict[str, Any]:
        return {"outer": self.outer.state_dict()} if self.outer is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.outer is not None and "outer" in state:
            self.outer.load_state_dict(state["outer"])

    def begin(self) -> None:
        """Remember the window's start (after its quorum, and a heal if there was one)."""
        with torch.no_grad():
            self._weights = [_local(p).detach().clone() for p in self.params]
        self._optimizer = copy.deepcopy(self.run.optimizer.state_dict())
        self._progress = dict(self.run.progress.state_dict())

    def rewind(self) -> None:
        """Back to the window's start: its sync did not commit."""
        with torch.no_grad():
            for p, saved in zip(self.params, self._weights):
                _local(p).copy_(saved)
        self.run.optimizer.load_state_dict(self._optimizer)
        self.run.progress.load_state_dict(self._progress)

    def sync(self, manager: Any, tail: torch.Tensor | None = None) -> bool:
        """Average over the groups; False (nothing changed) when the sync did not commit.
        ``tail``: more to average in the same all-reduce (the mean in :attr:`tail`)."""
        with torch.no_grad():
            now = [_local(p).detach() for p in self.params]
            if self.mode == "localsgd":
                parts = [t.reshape(-1) for t in now]
            else:  # the pseudo-gradient
                parts = [(s - t).reshape(-1) for s, t in zip(self._weights, now)]
            flat = torch.cat(parts + ([tail] if tail is not None else []))
        manager.allreduce(flat).wait()  # the mean over the participants
        if not manager.should_commit():
            return False
        self.tail = flat[flat.numel() - (tail.numel() if tail is not None else 0):]
        with torch.no_grad():
            at = 0
            for p, saved in zip(self.params, self._weights):
                local = _local(p)
                piece = flat[at:at + local.numel()].view_as(local)
                at += local.numel()
                if self.mode == "localsgd":
                    local.copy_(piece)
                else:
                    local.copy_(saved)
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    _local(p.grad).copy_(piece)
        if self.outer is not None:
            self.outer.step()
            self.outer.zero_grad(set_to_none=True)
        return True
