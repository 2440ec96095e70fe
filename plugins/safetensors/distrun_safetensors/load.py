"""Loading: find a valid checkpoint, check it fits, then each rank reads only its byte ranges.

All checks (manifest, indexes, headers, checksums, model fit) run before the first tensor is
touched, and every rank learns every other rank's verdict, so a bad checkpoint is either
loaded nowhere or, under ``latest``/``auto``, skipped everywhere for the previous one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import ExitStack, closing
from dataclasses import dataclass
from typing import Any, cast

import torch

from distrun_safetensors import comm
from distrun_safetensors.errors import NewerFormatError
from distrun_safetensors.files import CheckpointError, FileReaders
from distrun_safetensors.manifest import (
    BEST,
    LATEST,
    PART,
    STEP_RE,
    Checkpoint,
    best_candidates,
    candidates,
    is_checkpoint_folder,
)
from distrun_safetensors.paths import checked_path, read_member
from distrun_safetensors.pieces import DTYPES, box_of, covered, is_dtensor, read_box
from distrun_safetensors.rank_files import optimizer_names
from distrun_safetensors.statecodec import decode
from distrun_safetensors.validation import validate

__all__ = ["LoadResult", "NodeFolder", "load", "resolve_source"]

log = logging.getLogger("distrun")


class LoadResult:
    """What :func:`load` restored: the folder, its step and this rank's contributed state."""

    def __init__(self, path: str, step: int, state: dict[str, Any], bytes_read: int = 0) -> None:
        self.path = path
        self.step = step
        self.state = state
        #: tensor bytes this rank read from the model and optimizer files
        self.bytes_read = bytes_read


@dataclass(frozen=True)
class NodeFolder:
    """A folder of checkpoints whose committed ones compete with the checkpoint folder's
    under ``latest`` and ``auto`` (the memory tier's, see :func:`merge_newest`).

    Across nodes each node has its own (``mine``; ``named``: rank 0's, the one the choice
    names), holding what its ranks need; only the ``steps`` every node committed are
    candidates (None: all), and each node's ranks check its own (this rank is ``rank`` of
    ``world`` there)."""

    mine: str
    named: str
    steps: frozenset[int] | None
    rank: int
    world: int

    def here(self, folder: str) -> str | None:
        """``folder`` (as rank 0 names it) in this rank's own folder; None when not one of it."""
        if os.path.dirname(os.path.normpath(folder)) != os.path.normpath(self.named):
            return None
        return os.path.join(self.mine, os.path.basename(os.path.normpath(folder)))


def resolve_source(source: str, ckpt_dir: str,
                   pointer: str = LATEST) -> tuple[list[str], bool, list[str]]:
    """(folders to try, whether the user named one folder, notes on a broken pointer).

    ``source`` ``best`` (or ``pointer`` ``best`` with ``latest``, ``auto`` or a folder of
    checkpoints) follows the ``best`` pointer, then the other checkpoints that carry a value
    of the same monitored metric, best first.
    """
    if source == BEST:
        source, pointer = LATEST, BEST
    if source not in ("auto", "latest"):
        if not os.path.exists(source):
            raise CheckpointError(f"checkpoint {source} does not exist (give a step-N folder, a "
                                  "checkpoints folder or a run folder)")
        if is_checkpoint_folder(source):
            return [source], True, []
        nested = os.path.join(source, "checkpoints")
        has_own = any(n == "latest" or n.startswith("step-") for n in os.listdir(source))
        ckpt_dir = nested if os.path.isdir(nested) and not has_own else source
    folders, notes = best_candidates(ckpt_dir) if pointer == BEST else candidates(ckpt_dir)
    return folders, False, notes


def merge_newest(disk: list[str], memory: list[str]) -> list[str]:
    """The folders to try when the memory tier (``memory``, newest first) competes with the
    checkpoint folder (``disk``, in its own order): the memory's checkpoints of a step at
    least as new as the folder's first go before it (the same step: memory, the faster
    read), its older ones right after it."""
    if not disk:
        return list(memory)
    first = _step_of(disk[0])
    newer = [m for m in memory if _step_of(m) >= first]
    return newer + disk[:1] + [m for m in memory if m not in newer] + disk[1:]


def _step_of(folder: str) -> int:
    match = STEP_RE.match(os.path.basename(os.path.normpath(folder)))
    return int(match.group(1)) if match else -1


def _plan(source: str, ckpt_dir: str, pointer: str,
          tier: NodeFolder | None) -> tuple[list[str], bool, list[str]]:
    """:func:`resolve_source` on rank 0, with the memory tier's folders merged in, for every
    rank (every rank calls this together)."""
    plan: Any = None
    if comm.rank_world()[0] == 0:
        try:
            plan = resolve_source(source, ckpt_dir, pointer)
            if tier is not None and source in ("auto", "latest") and pointer == LATEST:
                folders, explicit, notes = plan
                memory = [f for f in candidates(tier.named)[0]
                          if tier.steps is None or _step_of(f) in tier.steps]
                plan = merge_newest(folders, memory), explicit, notes
        except CheckpointError as exc:
            plan = str(exc)
    plan = comm.broadcast(plan)
    if isinstance(plan, str):
        raise CheckpointError(plan)
    return cast(tuple[list[str], bool, list[str]], plan)


def checkpoint_found(source: str, ckpt_dir: str, pointer: str = LATEST,
                     tier: NodeFolder | None = None) -> bool:
    """Whether :func:`load` of the same arguments will restore a checkpoint (it restores one
    of the folders it tries, or raises), the same answer on every rank; checks nothing of
    the folders themselves (the load does)."""
    if source == BEST:
        source, pointer = LATEST, BEST
    try:
        return bool(_plan(source, ckpt_dir, pointer, tier)[0])
    except CheckpointError:
        return False  # the load says it


def _choose(source: str, ckpt_dir: str, verify: bool, pointer: str = LATEST,
            tier: NodeFolder | None = None,
            holds: Callable[[Checkpoint], str | None] | None = None) -> Checkpoint | None:
    """The first valid folder of ``source``. ``holds``: what a node's folder of the tier does
    not hold of this rank's tensors (a part, or a view whose other part is missing: the node
    that held it was lost before its copy of that step arrived); such a folder is skipped
    for the next, as a damaged one is."""
    rank, world = comm.rank_world()
    if source == BEST:
        source, pointer = LATEST, BEST
    folders, explicit, notes = _plan(source, ckpt_dir, pointer, tier)
    for note in notes:
        if rank == 0:
            log.warning("checkpoint: %s; looking for the %s valid checkpoint", note,
                        "best" if pointer == BEST else "newest")
    for folder in folders:
        ckpt: Checkpoint | None = None
        error: tuple[str, str] | None = None
        here = tier.here(folder) if tier is not None else None
        try:  # a node's folder is checked by its own ranks
            ckpt = validate(here, tier.rank, tier.world, verify, part=True) if here and tier \
                else validate(folder, rank, world, verify)
            gap = holds(ckpt) if here and holds is not None else None
            if gap is not None:
                error = ("bad", gap)
        except NewerFormatError as exc:  # not damaged: never skipped for an older one
            error = ("newer", str(exc))
        except CheckpointError as exc:
            error = ("bad", str(exc))
        except Exception as exc:  # malformed beyond what the checks name: still no hang
            error = ("bad", f"{folder}: unreadable ({type(exc).__name__}: {exc})")
        error = comm.agree(error)
        if error is None:
            return ckpt
        kind, message = error
        if kind == "newer":
            raise NewerFormatError(message)
        if explicit:
            raise CheckpointError(message)
        if rank == 0:
            log.warning("checkpoint: skipping %s: %s", folder, message)
    where = ckpt_dir if source in ("auto", "latest") else source
    if folders:
        raise CheckpointError(f"no valid checkpoint in {where}: all {len(folders)} are damaged "
                              "(see the warnings above)")
    if source == "auto":
        return None
    if pointer == BEST:
        raise CheckpointError(f"no best checkpoint in {where}: none records a monitored "
                              "metric (train with --ckpt-monitor METRIC first, or resume from "
                              "latest without --ckpt-resume-best)")
    raise CheckpointError(f"no checkpoint found in {where} "
                          "(train with --ckpt-every-n-steps N first, or use --resume auto)")


def _fit_problems(ckpt: Checkpoint, model: torch.nn.Module, optimizer: Any) -> str | None:
    sd = model.state_dict()
    missing = [k for k in sd if k not in ckpt.model]
    unexpected = [k for k in ckpt.model if k not in sd]
    wrong = []
    for k, t in sd.items():
        info = ckpt.model.get(k)
        if info is None:
            continue
        want = (DTYPES[info["dtype"]], list(info["shape"]))
        if (t.dtype, list(t.shape)) != want:
            wrong.append(f"{k}: checkpoint {info['dtype']}{info['shape']} vs model "
                         f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}")
    parts = []
    if missing:
        parts.append(f"missing from the checkpoint: {', '.join(missing[:5])}"
                     + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""))
    if unexpected:
        parts.append(f"not in the model: {', '.join(unexpected[:5])}"
                     + (f" (+{len(unexpected) - 5} more)" if len(unexpected) > 5 else ""))
    if wrong:
        parts.append("shape/dtype differ: " + "; ".join(wrong[:5]))
    if parts:
        return (f"{ckpt.folder} does not fit this model: " + " | ".join(parts)
                + " (load it into the model it was saved from)")
    gap = _gap(ckpt, model, optimizer)
    if gap is not None:
        return gap
    if optimizer is not None and ckpt.optimizer is not None:
        kind = ckpt.optimizer.get("class")
        if kind and kind != type(optimizer).__name__ and comm.rank_world()[0] == 0:
            log.warning("checkpoint: the optimizer state was saved from %s, this run uses %s",
                        kind, type(optimizer).__name__)
        saved = [g.get("params") for g in ckpt.optimizer.get("param_groups", [])]
        now = optimizer_names(optimizer, model)
        if saved != now:
            return (f"{ckpt.folder}: the optimizer's parameter groups differ from the saved ones "
                    f"(saved {_brief(saved)}, now {_brief(now)})")
    return None


def _optimizer_gap(ckpt: Checkpoint, model: torch.nn.Module, optimizer: Any) -> str | None:
    """The first optimizer tensor whose part this rank reads (:func:`_read_like`) the folder
    does not hold; None when it holds them all."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    names = [n for row in optimizer_names(optimizer, model) for n in row]
    for name, param in zip(names, params, strict=True):
        for value in (ckpt.optimizer or {}).get("state", {}).get(name, {}).values():
            if not (isinstance(value, dict) and set(value) == {"__tensor__"}):
                continue
            info = ckpt.optim[value["__tensor__"]]
            box = _optim_box(info, param)
            if box is not None and not covered(info, *box):
                return str(value["__tensor__"])
    return None


def _brief(groups: Any) -> str:
    return str([g[:3] + ["..."] if isinstance(g, list) and len(g) > 3 else g for g in groups])


def load(source: str, model: torch.nn.Module, optimizer: Any = None, *, ckpt_dir: str = "",
         verify: bool = True, pointer: str = LATEST,
         tier: NodeFolder | None = None) -> LoadResult | None:
    """Restore ``model`` (and ``optimizer``) in place on every rank; None when ``auto`` finds
    nothing. Raises :class:`CheckpointError` before changing anything when the checkpoint is
    damaged or does not fit.

    ``source``: ``latest``, ``auto``, ``best`` or a path; ``pointer="best"`` makes
    ``latest``/``auto``/a checkpoints folder follow ``best`` instead of ``latest``. ``tier``:
    a folder whose checkpoints compete with ``ckpt_dir``'s under ``latest`` and ``auto``
    (:class:`NodeFolder`, the memory tier's).
    """
    ckpt = _choose(source, ckpt_dir, verify, pointer, tier,
                   lambda found: _gap(found, model, optimizer))
    if ckpt is None:
        return None
    problem = None
    try:
        problem = _fit_problems(ckpt, model, optimizer)
    except CheckpointError as exc:
        problem = str(exc)
    except Exception as exc:
        problem = f"{ckpt.folder}: unreadable ({type(exc).__name__}: {exc})"
    problem = comm.agree(problem)
    if problem:
        raise CheckpointError(problem)
    with ExitStack() as stack:
        open_file = stack.enter_context(closing(FileReaders(ckpt.path)))
        try:
            _load_model(ckpt, model, open_file)
            if optimizer is not None and ckpt.optimizer is not None:
                _load_optimizer(ckpt, model, optimizer, open_file)
            state = _load_state(ckpt, stack)
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{ckpt.folder}: reading failed ({exc})") from exc
        read = sum(h.bytes_read for h in open_file.opened.values())
    return LoadResult(ckpt.folder, ckpt.step, state, read)


def _load_model(ckpt: Checkpoint, model: torch.nn.Module, open_file: Any) -> None:
    with torch.no_grad():
        for name, t in model.state_dict().items():
            box = box_of(t)
            if box is None:
                continue
            local = t.to_local() if is_dtensor(t) else t
            if local.numel() == 0:
                continue
            read_box(open_file, ckpt.model[name], *box, local)


def _gap(ckpt: Checkpoint, model: torch.nn.Module, optimizer: Any) -> str | None:
    """A tensor this rank reads that the folder does not hold all of (an incomplete
    checkpoint, or a node's part of one), said; None: it holds every one, or it is not this
    model's (:func:`_fit_problems` says how)."""
    sd = model.state_dict()
    if set(sd) != set(ckpt.model):
        return None
    for k, t in sd.items():
        box = box_of(t)
        if box is not None and not covered(ckpt.model[k], *box):
            return f"{ckpt.folder}: tensor {k!r} is not fully stored (incomplete checkpoint)"
    if PART in ckpt.manifest and optimizer is not None and ckpt.optimizer is not None:
        missing = _optimizer_gap(ckpt, model, optimizer)  # a node's part: what this rank reads
        if missing is not None:
            return f"{ckpt.folder}: tensor {missing!r} is not fully stored here (a part)"
    return None


def _optim_box(info: dict[str, Any], param: torch.Tensor) -> tuple[list[int], list[int]] | None:
    """The block of a saved optimizer tensor this rank reads for ``param``: its shard where
    ``param`` is a DTensor of the tensor's shape (None: it holds none), else all of it."""
    if is_dtensor(param) and list(info["shape"]) == list(param.shape):
        return box_of(param)
    return [0] * len(info["shape"]), list(info["shape"])


def _read_like(ckpt: Checkpoint, tname: str, param: torch.Tensor, open_file: Any) -> Any:
    info = ckpt.optim[tname]
    dtype = DTYPES[info["dtype"]]
    if is_dtensor(param) and list(info["shape"]) == list(param.shape):
        from torch.distributed.tensor import DTensor

        offsets, shape = _optim_box(info, param) or ([0] * param.dim(), [0] * param.dim())
        local = torch.empty(shape, dtype=dtype)
        if local.numel():
            read_box(open_file, info, offsets, shape, local)
        return DTensor.from_local(local.to(param.device), param.device_mesh, param.placements,
                                  run_check=False, shape=param.shape, stride=param.stride())
    full = torch.empty(info["shape"], dtype=dtype)
    if full.numel():
        read_box(open_file, info, [0] * full.dim(), list(full.shape), full)
    return full


def _load_optimizer(ckpt: Checkpoint, model: torch.nn.Module, optimizer: Any,
                    open_file: Any) -> None:
    meta = ckpt.optimizer or {}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    names = [n for row in optimizer_names(optimizer, model) for n in row]
    state: dict[int, dict[str, Any]] = {}
    for i, (name, param) in enumerate(zip(names, params, strict=True)):
        entry = meta.get("state", {}).get(name)
        if entry is None:
            continue
        values = {}
        for skey, v in entry.items():
            if isinstance(v, dict) and set(v) == {"__tensor__"}:
                values[skey] = _read_like(ckpt, v["__tensor__"], param, open_file)
            else:
                values[skey] = decode(v, None)
        state[i] = values
    groups, start = [], 0
    for g in meta["param_groups"]:
        n = len(g["params"])
        groups.append({**{k: decode(v, None) for k, v in g.items() if k != "params"},
                       "params": list(range(start, start + n))})
        start += n
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _load_state(ckpt: Checkpoint, stack: ExitStack) -> dict[str, Any]:
    """This rank's contributed state (the first saved rank's at another world size), from the
    state files :func:`validate` checked (names, and that the JSON is data referring to stored
    tensors). A save across some ranks (one node's) names whose states it holds."""
    rank, world = comm.rank_world()
    if not ckpt.states:
        return {}
    ranks = ckpt.manifest["states"].get("ranks")
    if ranks is not None:
        index = ranks.index(rank) if rank in ranks else 0
    else:
        index = rank if len(ckpt.states) == world else 0
    json_name, tensor_name = ckpt.states[index]
    import json

    data = json.loads(read_member(ckpt.folder, json_name, 1 << 30, "state"))
    getter = None
    if tensor_name is not None:
        from safetensors import safe_open

        handle = stack.enter_context(safe_open(checked_path(ckpt.folder, tensor_name),
                                               framework="pt", device="cpu"))

        def getter(key: str) -> torch.Tensor:
            return handle.get_tensor(key)

    return decode(data, getter)
