"""Start from Hugging Face weights (``--init-weights``): a sharded safetensors folder or one file.

Reads the layout ``save_pretrained`` writes (``model.safetensors.index.json`` naming each
tensor's shard, ``model-00001-of-0000N.safetensors``; or a single ``model.safetensors``), and
the one ``distrun ckpt consolidate`` writes. Every header is checked and the names and shapes
are matched against the model before a byte of tensor data is read; then each rank opens one
shard at a time with ``safe_open`` and reads only what it holds: the whole tensor for a plain
(single, DDP) model, its local block for an FSDP/TP DTensor, copied straight into the
parameter (cast to its dtype). No full copy of the model is ever made.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from distrun.plugin import UsageError
from distrun_safetensors.files import read_header
from distrun_safetensors.paths import checked_path, member, read_member

__all__ = ["WeightsResult", "find_weights", "load_weights", "parse_prefix"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_SHOW = 4  # names listed in one error line
_observers: list[Callable[[str], None]] = []


def observe_open(fn: Callable[[str], None]) -> Callable[[], None]:
    """Call ``fn(path)`` right after each shard is opened for reading (tests look at what
    the process holds open then). Returns a function that removes the observer."""
    _observers.append(fn)
    return lambda: _observers.remove(fn)


@dataclass
class Source:
    """Checked weights on disk: the shard files in order and every tensor's file and header."""

    path: str
    files: dict[str, str]  # shard name -> path, in reading order
    tensors: dict[str, tuple[str, str, list[int], int]]  # key -> (shard, dtype, shape, offset)


@dataclass
class WeightsResult:
    """What :func:`load_weights` did on this rank."""

    path: str
    loaded: list[str] = field(default_factory=list)  # model names filled
    missing: list[str] = field(default_factory=list)  # model names not in the files
    unexpected: list[str] = field(default_factory=list)  # file names the model does not have
    mismatched: list[str] = field(default_factory=list)  # "name: file [..] vs model [..]"
    tied: list[str] = field(default_factory=list)  # "name = other": filled through an alias
    cast: dict[str, int] = field(default_factory=dict)  # "BF16 -> float32" -> tensors
    files_opened: list[str] = field(default_factory=list)  # shard names, in opening order
    max_open: int = 0  # shard files open at the same time, at most
    bytes_read: int = 0  # tensor bytes this rank read

    def report(self) -> list[str]:
        """Log lines (rank 0 logs them)."""
        lines = [f"Initial weights from {self.path}: {len(self.loaded)} tensors from "
                 f"{len(self.files_opened)} file(s)"]
        for what, n in sorted(self.cast.items()):
            lines.append(f"  note: {n} tensor(s) cast {what} (the model's dtype)")
        if self.tied:
            lines.append(f"  tied: {_few(self.tied)}")
        for title, names in (("not in the files, left as initialised", self.missing),
                             ("in the files, not in the model", self.unexpected),
                             ("skipped, shapes differ", self.mismatched)):
            if names:
                lines.append(f"  {title}: {_few(names, 20)}")
        return lines


def _few(names: list[str], n: int = _SHOW) -> str:
    more = f" (+{len(names) - n} more)" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def parse_prefix(text: str) -> tuple[str, str]:
    """``OLD=NEW`` -> (OLD, NEW); ``OLD`` alone strips OLD; ``=NEW`` adds NEW."""
    old, sep, new = (text or "").partition("=")
    if "=" in new:
        raise UsageError(f"--init-weights-prefix {text!r}: give OLD=NEW (one '='), e.g. "
                         "'model.' to strip it or '=model.' to add it")
    return old, new if sep else ""


def _rename(key: str, old: str, new: str) -> str:
    return new + key[len(old):] if key.startswith(old) else key


# -- the files (torch-free) ---------------------------------------------------------------------


def find_weights(path: str) -> Source:
    """Check ``path`` (a folder or a file) and every shard's header; UsageError naming the
    problem otherwise."""
    if not os.path.exists(path):
        raise UsageError(f"--init-weights {path}: no such file or folder (give a folder with "
                         f"{INDEX} and its shards, or a .safetensors file)")
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "manifest.json")) \
                or os.path.exists(os.path.join(path, "latest")):
            # its tensors may be stored in pieces (keys `name@offsets`): not HF's layout
            raise UsageError(f"--init-weights {path} is a distrun checkpoint, not Hugging Face "
                             "weights: resume it with --resume PATH, or export its weights with "
                             "`distrun ckpt consolidate PATH OUT` and give OUT")
        if os.path.lexists(os.path.join(path, INDEX)):
            return _from_index(path, INDEX, path)
        if os.path.lexists(os.path.join(path, SINGLE)):
            return _from_files(path, path, [SINGLE])
        raise UsageError(f"--init-weights {path}: the folder has neither {INDEX} nor {SINGLE} "
                         "(give the folder save_pretrained wrote, or a .safetensors file)")
    if path.endswith(".index.json"):
        return _from_index(os.path.dirname(os.path.abspath(path)), os.path.basename(path), path)
    if path.endswith(".safetensors"):
        folder = os.path.dirname(os.path.abspath(path))
        return _from_files(path, folder, [os.path.basename(path)])
    raise UsageError(f"--init-weights {path}: not a .safetensors file nor an .index.json "
                     "(give the folder save_pretrained wrote, or a .safetensors file)")


def _from_index(folder: str, name: str, shown: str = "") -> Source:
    index_path = os.path.join(folder, name)
    try:  # through the one checked open: never a link out of the folder, never a FIFO
        index = json.loads(read_member(folder, name, 256 * 1024 * 1024, "the index",
                                       kind="weights"))
    except UsageError as exc:
        raise UsageError(f"--init-weights {shown or index_path}: {exc}") from None
    except OSError as exc:
        raise UsageError(f"--init-weights {index_path}: cannot read it ({exc.strerror})") from None
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise UsageError(f"--init-weights {index_path} is not valid JSON") from None
    if isinstance(index, dict) and "distrun" in index:
        raise UsageError(f"--init-weights {index_path} indexes a distrun checkpoint, not Hugging "
                         "Face weights: export them with `distrun ckpt consolidate PATH OUT` and "
                         "give OUT")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map \
            or not all(isinstance(v, str) for v in weight_map.values()):
        raise UsageError(f"--init-weights {index_path}: no weight_map of tensor names to shard "
                         "files (not a Hugging Face index)")
    shards = sorted(set(weight_map.values()))
    source = _from_files(shown or index_path, folder, shards)
    for key, shard in weight_map.items():
        found = source.tensors.get(key)
        if found is None or found[0] != shard:
            raise UsageError(f"--init-weights {os.path.join(folder, shard)}: tensor {key!r} "
                             f"named by {os.path.basename(index_path)} is not in it (an "
                             "incomplete or mixed-up folder)")
    # the index is the list of tensors: a key a shard holds but the index does not name is not
    # part of the weights (Hugging Face's loaders read the same way)
    source.tensors = {k: source.tensors[k] for k in weight_map}
    return source


def _from_files(shown: str, folder: str, shards: list[str]) -> Source:
    files: dict[str, str] = {}
    tensors: dict[str, tuple[str, str, list[int], int]] = {}
    for shard in shards:
        try:
            path = member(folder, shard, kind="weights")
        except UsageError as exc:
            raise UsageError(f"--init-weights {shown}: {exc}") from None
        if not os.path.lexists(path):
            raise UsageError(f"--init-weights {path} is missing (the index names it)")
        try:  # one line naming the file if it is not a regular safetensors file
            header, _ = read_header(path)
        except UsageError as exc:
            raise UsageError(f"--init-weights {shown}: {exc}") from None
        files[shard] = path
        for key, info in header.items():
            if key in tensors:
                raise UsageError(f"--init-weights {shown}: tensor {key!r} is in both "
                                 f"{tensors[key][0]} and {shard}")
            tensors[key] = (shard, info["dtype"], list(info["shape"]), info["data_offsets"][0])
    return Source(shown, files, tensors)


# -- matching and loading ----------------------------------------------------------------------


def _aliases(model: Any) -> dict[str, list[str]]:
    """Names sharing one tensor (tied weights), keyed by each name."""
    groups: dict[int, list[str]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)]:
        groups.setdefault(id(t), []).append(name)
    return {n: g for g in groups.values() if len(g) > 1 for n in g}


def _suggest(missing: list[str], unexpected: list[str]) -> str:
    """An --init-weights-prefix that turns the file's names into the model's, if one does."""
    from collections import Counter

    best, score = "", 0
    # strip a head the file's names have (HF's `model.`), or add one the model's names have
    for names, other, form in ((unexpected, set(missing), "{}"),
                               (missing, set(unexpected), "={}")):
        heads: Counter[str] = Counter()
        for name in names:
            for i, c in enumerate(name):
                if c == "." and name[i + 1:] in other:
                    heads[name[:i + 1]] += 1
        if heads:
            head, count = heads.most_common(1)[0]
            if count > score:
                best, score = form.format(head), count
    return f"--init-weights-prefix {best}" if best else ""


def match(source: Source, model: Any, prefix: str = "",
          strict: bool = True) -> tuple[dict[str, list[tuple[str, str]]], WeightsResult]:
    """Which file tensor fills which model tensor, by shard: ``{shard: [(key, name)]}``.

    Raises UsageError (one line) when ``strict`` and anything is missing, left over or shaped
    differently; otherwise the result lists what is skipped.
    """
    from distrun_safetensors.pieces import safetensors_dtype

    old, new = parse_prefix(prefix)
    renamed: dict[str, str] = {}
    for key in source.tensors:
        name = _rename(key, old, new)
        if name in renamed:
            raise UsageError(f"--init-weights-prefix {prefix!r} maps both {renamed[name]!r} and "
                             f"{key!r} of {source.path} to {name!r} (choose another prefix)")
        renamed[name] = key
    sd = model.state_dict()
    aliases = _aliases(model)
    result = WeightsResult(source.path)
    plan: dict[str, list[tuple[str, str]]] = {}
    used: set[str] = set()
    for name, t in sd.items():
        key = renamed.get(name)
        if key is None:
            twin = next((a for a in aliases.get(name, []) if a in renamed and a in sd), None)
            if twin is not None:  # a tied weight: saved once, under its other name
                result.tied.append(f"{name} = {twin}")
            else:
                result.missing.append(name)
            continue
        used.add(key)
        shard, dtype, shape, _ = source.tensors[key]
        if list(shape) != list(t.shape):
            result.mismatched.append(f"{name}: file {shape} vs model {list(t.shape)}")
            continue
        mine = safetensors_dtype(t.dtype)
        if dtype != mine:
            what = f"{dtype} -> {str(t.dtype).removeprefix('torch.')}"
            result.cast[what] = result.cast.get(what, 0) + 1
        plan.setdefault(shard, []).append((key, name))
        result.loaded.append(name)
    result.unexpected = [_rename(k, old, new) for k in source.tensors if k not in used]
    if strict and (result.missing or result.unexpected or result.mismatched):
        parts = []
        if result.missing:
            parts.append(f"missing from it: {_few(result.missing)}")
        if result.unexpected:
            parts.append(f"not in the model: {_few(result.unexpected)}")
        if result.mismatched:
            parts.append(f"shapes differ: {_few(result.mismatched)}")
        fix = _suggest(result.missing, [k for k in source.tensors if k not in used])
        fix = f"{fix} renames them" if fix else (
            "--no-init-weights-strict loads the tensors that match and logs the rest")
        raise UsageError(f"--init-weights {source.path} does not fit the model: "
                         + " | ".join(parts) + f" ({fix})")
    order = {shard: i for i, shard in enumerate(source.files)}
    plan = dict(sorted(plan.items(), key=lambda kv: order[kv[0]]))
    for items in plan.values():  # read each file front to back
        items.sort(key=lambda kn: source.tensors[kn[0]][3])
    return plan, result


def load_weights(path: str, model: Any, *, prefix: str = "", strict: bool = True) -> WeightsResult:
    """Fill ``model``'s tensors in place from Hugging Face safetensors weights at ``path``.

    Every rank calls it (a plain, FSDP or TP model); each reads only the blocks it holds. All
    checks run, and every rank learns every other rank's verdict, before anything is copied.
    ``prefix``: see :func:`parse_prefix`. ``strict=False`` loads what matches by name and shape.
    """
    import torch

    from distrun_safetensors import comm
    from distrun_safetensors.pieces import box_of, is_dtensor

    plan, result, error = None, None, None
    try:
        source = find_weights(path)
        plan, result = match(source, model, prefix, strict)
    except UsageError as exc:
        error = str(exc)
    error = comm.agree(error)
    if error or plan is None or result is None:
        raise UsageError(error or f"--init-weights {path}: not loaded")
    from safetensors import safe_open

    sd = model.state_dict()
    open_now = 0
    with torch.no_grad():
        for shard, items in plan.items():
            open_now += 1
            result.max_open = max(result.max_open, open_now)
            result.files_opened.append(shard)
            path = checked_path(os.path.dirname(source.files[shard]), shard, "weights")
            with safe_open(path, framework="pt", device="cpu") as fh:
                for fn in tuple(_observers):
                    fn(source.files[shard])
                for key, name in items:
                    t = sd[name]
                    box = box_of(t)
                    local = t.to_local() if is_dtensor(t) else t
                    if box is None or local.numel() == 0:
                        continue
                    offsets, shape = box
                    if t.dim() == 0 or list(shape) == list(t.shape):
                        src = fh.get_tensor(key)
                    else:
                        src = fh.get_slice(key)[tuple(slice(o, o + s)
                                                      for o, s in zip(offsets, shape, strict=True))]
                    local.copy_(src)
                    result.bytes_read += src.numel() * src.element_size()
                    del src
            open_now -= 1
    return result
