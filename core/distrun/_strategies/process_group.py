"""torch.distributed helpers shared by strategies: device choice and process-group setup."""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from distrun._config.run_config import RunConfig
from distrun._registry.collect import choose_backends, collect_backends
from distrun._spec.backends import BackendInfo
from distrun._spec.errors import UsageError

__all__ = ["device_backend", "env_topology", "init_process_group", "join_process_group",
           "prepare_backend", "select_device"]

log = logging.getLogger("distrun")


def env_topology() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's environment (0, 0, 1 when absent)."""
    return (int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0")),
            int(os.environ.get("WORLD_SIZE", "1")))


def select_device(config: RunConfig, local_rank: int) -> torch.device:
    """CUDA device ``local_rank`` when asked for (or 'auto' and available), else CPU."""
    want = config.device
    if want == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for but no CUDA device is visible "
                         "(use --device cpu)")
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def init_process_group(config: RunConfig, device: torch.device, backend: str | None = None) -> bool:
    """Join the default process group from torchrun's env; True if this call created it.

    The collective timeout is ``config.timeout`` seconds (torch's gloo default is 30 minutes:
    a rank that stalls must fail the run quickly instead).
    """
    rank, _, world = env_topology()
    if dist.is_available() and dist.is_initialized():
        return False
    if "MASTER_ADDR" not in os.environ:
        raise UsageError(
            f"{world} processes need a rendezvous: start them with `distrun run "
            "--nproc-per-node N ...` (MASTER_ADDR is not set)"
        )
    if backend is None:
        backend = prepare_backend(config, device.type)
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        kwargs["device_id"] = device
    timeout = datetime.timedelta(seconds=config.timeout)
    dist.init_process_group(backend=backend, store=_group_store(rank, world, timeout),
                            rank=rank, world_size=world, timeout=timeout, **kwargs)
    # Every rank says it joined (as Lightning does); rank 0 then says the group is complete.
    print(f"Initializing distributed: GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/{world}",
          flush=True)
    if rank == 0:
        log.info("distributed_backend=%s: all %d processes registered", backend, world)
    return True


#: per (process id, MASTER_ADDR, MASTER_PORT): the rendezvous store, and how many groups this
#: process has made on it (a forked child's pid is its own: it makes its own connection)
_rendezvous: dict[tuple[int, str, str], tuple[Any, int]] = {}


def _group_store(rank: int, world: int, timeout: datetime.timedelta) -> Any:
    """The store a new default group meets on: env://'s store, under a prefix of its own.

    A notebook's or a sweep's fits, one after another in one process, meet on one port. With
    env:// as torch does it each group would use the same keys, on a store rank 0 closes
    when its group goes: a rank that starts the next fit before rank 0 has closed the last
    one's group reaches that old store and reads the last group's keys (gloo then connects
    to a port long closed), or is cut off when the old store closes. So the store is kept for
    the life of the process (rank 0 serves it on), and the n-th group this process makes on
    that address meets under ``distrun/group/<n>/``: every rank makes the same groups in the
    same order. The store still comes from torch's env:// rendezvous, so the launcher's
    socket (``distrun._worker.store``) and torchrun's agent store serve it as before.
    """
    key = (os.getpid(), os.environ["MASTER_ADDR"], os.environ.get("MASTER_PORT", ""))
    store, made = _rendezvous.get(key, (None, 0))
    if store is None:
        store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
    _rendezvous[key] = (store, made + 1)
    store.set_timeout(timeout)
    return dist.PrefixStore(f"distrun/group/{made + 1}", store)


def prepare_backend(config: RunConfig, device_type: str | None = None,
                    pm: Any = None) -> str:
    """The backend string for ``init_process_group``, its backends checked and loaded.

    ``--backend auto`` keeps torch's default (nccl on CUDA, gloo on CPU). A named backend that
    cannot run here, or that does not serve ``device_type``, is a one-line UsageError. A
    plugin's backend also becomes torch's default for its devices, so a plain script's
    ``init_process_group()`` (no backend named) uses it.
    """
    from distrun._registry.manager import manager_of

    backends = collect_backends(pm if pm is not None else manager_of(config))
    chosen = choose_backends(config, backends)
    if not chosen:
        return "nccl" if device_type == "cuda" else "gloo"
    for info in chosen.values():
        _make_available(info, backends)
    if "*" in chosen:
        info = chosen["*"]
        if device_type is not None and device_type not in info.devices:
            other = dist.Backend.default_device_backend_map.get(device_type, "gloo")
            raise UsageError(
                f"backend '{info.name}' serves {', '.join(info.devices)} but this run is on "
                f"{device_type} (use a device map such as --backend "
                f"{info.devices[0]}:{info.name},{device_type}:{other}, or --device "
                f"{info.devices[0]})")
        if info.load is not None:
            _make_torch_default(info.devices, info.name)
        return info.name
    names = {dev: info.name for dev, info in chosen.items()}
    if device_type is not None and device_type not in names:
        names[device_type] = dist.Backend.default_device_backend_map.get(device_type, "gloo")
    for dev, info in chosen.items():
        if info.load is not None:
            _make_torch_default((dev,), info.name)
    return ",".join(f"{dev}:{name}" for dev, name in names.items())


def _make_torch_default(devices: tuple[str, ...], name: str) -> None:
    """Make the plugin backend ``name`` torch's default for ``devices``, so a plain script's
    ``init_process_group()`` that names no backend joins on the one ``--backend`` chose.

    The one place distrun changes torch's state for a backend: ``init_process_group`` without
    a backend reads the class attribute ``Backend.default_device_backend_map``, and torch has
    no public setter or per-process default to use instead.
    """
    for dev in devices:
        dist.Backend.default_device_backend_map[dev] = name


def _make_available(info: BackendInfo, backends: dict[str, BackendInfo]) -> None:
    reason = info.unavailable()
    if reason is not None:
        usable = sorted(n for n, i in backends.items() if n != info.name and i.unavailable() is None)
        raise UsageError(f"backend '{info.name}' cannot run here: {reason} (available here: "
                         f"{', '.join(usable) or 'none'})")
    info.make_available()


def device_backend(device_type: str) -> str | None:
    """The name of the default group's backend for ``device_type`` (``None``: no group, or none
    for that device)."""
    if not dist.is_initialized():
        return None
    for pair in dist.get_backend_config().split(","):
        dev, _, name = pair.partition(":")
        if dev == device_type:
            return name
    return None


def join_process_group(config: RunConfig | None = None, *, store: Any = None, rank: int = 0,
                       world_size: int = 1, device_type: str = "cpu",
                       backend: str | None = None) -> bool:
    """Join a process group of a strategy's own; True if this call created it (nothing
    happens when a group already exists).

    Without ``store``: a real one-rank group over an in-memory store, for a strategy run by
    one process that still wants collectives and a device mesh, so the same code path runs
    at any world size. With one (a ``torch.distributed`` store, e.g. a ``PrefixStore`` over
    the run's): rank ``rank`` of ``world_size``, for ranks that form a group of their own
    (the rpc plugin's trainers). The backend is ``backend``, else ``config``'s ``--backend``
    for ``device_type`` (checked and loaded), else gloo; with ``config`` the collectives time
    out after ``config.timeout`` seconds.
    """
    if dist.is_initialized():
        return False
    if backend is None:
        backend = prepare_backend(config, device_type) if config is not None else "gloo"
    kwargs: dict[str, Any] = {}
    if config is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=config.timeout)
    dist.init_process_group(backend, store=dist.HashStore() if store is None else store,
                            rank=rank, world_size=world_size, **kwargs)
    return True
