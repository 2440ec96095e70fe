"""The backend contract: a communication backend offered by a plugin (``--backend NAME``).

Torch-free, like :mod:`distrun._spec.strategy`: the launcher collects the names to validate
``--backend`` and to list them, without importing torch. Only workers and ``distrun env``
call ``load`` and ``check``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from distrun._spec.targets import import_target

__all__ = ["BackendInfo", "parse_backend", "resolve"]


@dataclass(frozen=True)
class BackendInfo:
    """A process-group backend offered through ``distrun_register_backends``.

    - ``name``: what ``--backend`` takes (``gloo``, ``nccl``, ``shm``), alone or in a device
      map (``cpu:shm,cuda:nccl``).
    - ``devices``: the device types its collectives serve (``("cpu",)``, ``("cuda",)``).
    - ``check``: returns ``None`` when the backend can run here, else the reason it cannot
      (one line: "no CUDA device is visible"). Called in workers and by ``distrun env``.
    - ``load``: makes ``torch.distributed`` know the name (imports an extension module and calls
      ``torch.distributed.Backend.register_backend``); ``None`` for torch's own backends.
      Called once per worker, before the process group is made. May compile, and should say so.
    - ``single_node``: the backend only reaches ranks on one machine; a run of several nodes
      that asks for it is refused by the launcher with the name of one that reaches them.
    Both callables may be given as ``"module:function"`` strings: the plugin's entry point then
    imports nothing heavy, and the module is imported only where it is called.
    """

    name: str
    devices: tuple[str, ...]
    check: Callable[[], str | None] | str
    load: Callable[[], None] | str | None = None
    single_node: bool = False
    help: str = ""
    plugin: str = "core"

    def unavailable(self) -> str | None:
        """Why the backend cannot run here (``None`` when it can); an error in ``check`` is one."""
        try:
            reason: str | None = resolve(self.check)()
        except Exception as exc:  # a broken check says so rather than hiding the backend
            reason = f"its check failed: {type(exc).__name__}: {exc}"
        return reason

    def make_available(self) -> None:
        """Run ``load`` (once per process: ``load`` functions must be idempotent)."""
        if self.load is not None:
            resolve(self.load)()


def resolve(target: Callable[..., Any] | str) -> Callable[..., Any]:
    """``target`` itself, or the function a ``"module:function"`` string names (imported now)."""
    if not isinstance(target, str):
        return target
    module, sep, attr = target.partition(":")
    if not (module and sep and attr):
        raise ValueError(f"a backend function string is 'module:function', not {target!r}")
    function: Callable[..., Any] = import_target(target)
    return function


def parse_backend(text: str) -> dict[str, str]:
    """``--backend``'s value as {device type: backend name}; ``"*"`` is "every device".

    ``gloo`` -> ``{"*": "gloo"}``; ``cpu:shm,cuda:nccl`` -> ``{"cpu": "shm", "cuda": "nccl"}``;
    ``auto`` -> ``{}`` (torch's default: nccl on CUDA, gloo on CPU). The form torch's
    ``init_process_group`` takes; a ValueError names what is wrong.
    """
    text = text.strip()
    if text in ("", "auto"):
        return {}
    if ":" not in text:
        if "," in text or not text.replace("_", "").replace("-", "").isalnum():
            raise ValueError("is not a backend name (one name such as gloo, or a "
                             "device map such as cpu:gloo,cuda:nccl)")
        return {"*": text.lower()}
    out: dict[str, str] = {}
    for part in text.split(","):
        device, sep, name = (p.strip() for p in part.partition(":"))
        if not (device and sep and name) or device in out:
            raise ValueError("is not a device map (write DEVICE:NAME pairs once per "
                             "device, joined by commas: cpu:gloo,cuda:nccl)")
        out[device.lower()] = name.lower()
    return out
