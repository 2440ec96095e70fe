"""Checking a checkpoint folder before anything is read from it. Torch-free.

One copy for every reader: ``--resume`` (each rank checks its share), ``distrun ckpt verify``,
``inspect``, ``ls`` and ``consolidate`` run the same :func:`validate`, so the command line never
passes a checkpoint that a resume would refuse. The only checks left to the loader are those
that need the model (names, shapes and dtypes against its ``state_dict``).
"""

from __future__ import annotations

import os
from typing import Any

from distrun_safetensors.checksums import file_checksum
from distrun_safetensors.errors import CheckpointError
from distrun_safetensors.files import DTYPE_SIZES, read_header
from distrun_safetensors.manifest import (
    MODEL_INDEX,
    OPTIM_INDEX,
    OPTIM_JSON,
    PART,
    TENSORS,
    Checkpoint,
    check_version,
    read_json,
    read_manifest,
    state_files,
)
from distrun_safetensors.paths import member
from distrun_safetensors.statecodec import check_encoded

__all__ = ["check_tensor", "validate"]


def validate(folder: str, rank: int = 0, world: int = 1, verify: bool = True,
             part: bool = False) -> Checkpoint:
    """Check a checkpoint folder; raise :class:`CheckpointError` naming the first bad file.

    ``part``: the folder may be one node's part of a memory checkpoint (``manifest.PART``, see
    replica.py), whose pieces do not tile the tensors (the loader then checks that they hold
    what each rank reads); any other caller refuses such a folder.

    Every caller checks the manifest (its version, file list, state files and tensor record),
    the indexes, ``optimizer.json`` and every file's size. The other files are split among
    ``world`` callers (``rank`` checks files ``rank, rank + world, ...``): safetensors headers
    against the indexes, state JSON (well formed, its tensors present) and, with ``verify``,
    checksums. Together the ranks read each byte once.
    """
    manifest = read_manifest(folder)
    if PART in manifest and not part:
        raise CheckpointError(f"{folder} is one node's part of a memory checkpoint, not a whole "
                              "checkpoint (only a resume from that node's memory reads it)")
    files = manifest["files"]
    ckpt = Checkpoint(folder=folder, manifest=manifest)
    for name, info in files.items():
        path = member(folder, name)
        try:
            size = os.path.getsize(path)
        except OSError:
            raise CheckpointError(f"{path} is missing (the manifest lists it)") from None
        if size != info["size"]:
            raise CheckpointError(f"{path} is {size} bytes, the manifest says {info['size']} "
                                  "(truncated or replaced)")
    ckpt.states = _check_states(folder, manifest)
    for name, attr in ((MODEL_INDEX, "model"), (OPTIM_INDEX, "optim")):
        if name in files:
            index = read_json(folder, name, "index", files[name], verify, ckpt.checksum)
            setattr(ckpt, attr, _check_index(folder, name, index, manifest, PART not in manifest))
    if OPTIM_JSON in files:
        ckpt.optimizer = read_json(folder, OPTIM_JSON, "optimizer state", files[OPTIM_JSON],
                                   verify, ckpt.checksum)
        _check_optimizer(os.path.join(folder, OPTIM_JSON), ckpt.optimizer, ckpt.optim)
    expected: dict[str, dict[str, tuple[str, list[int]]]] = {}
    for tensors in (ckpt.model, ckpt.optim):
        for info in tensors.values():
            for piece in info["pieces"]:
                expected.setdefault(piece["file"], {})[piece["key"]] = (
                    info["dtype"], piece["shape"])
    state_json = {json_name: tensor_name for json_name, tensor_name in ckpt.states}
    for name in sorted(files)[rank::world]:
        path = member(folder, name)
        if name in state_json:  # read once: size, checksum, then what it holds
            _check_state(folder, name, state_json[name], ckpt, verify)
            continue
        if verify and files[name].get(ckpt.checksum) != file_checksum(path, ckpt.checksum):
            raise CheckpointError(f"{path}: checksum mismatch (corrupted file)")
        if not name.endswith(".safetensors"):
            continue
        header, _ = read_header(path)
        for key, (dtype, shape) in expected.get(name, {}).items():
            got = header.get(key)
            if got is None:
                raise CheckpointError(f"{path}: tensor {key!r} named by the index is missing")
            if got["dtype"] != dtype or got["shape"] != shape:
                raise CheckpointError(
                    f"{path}: tensor {key!r} is {got['dtype']}{got['shape']} but the index "
                    f"says {dtype}{shape}")
    return ckpt


# -- the manifest's state files -------------------------------------------------------------------


def _check_states(folder: str, manifest: dict[str, Any]) -> list[tuple[str, str | None]]:
    """``[(state JSON, state tensors or None)]`` per saved rank, each named exactly as the
    writer names them and listed in ``files`` (so its size and checksum are checked)."""
    where = os.path.join(folder, "manifest.json")
    states = manifest.get("states")
    if states is None:
        return []
    saved = states.get("files") if isinstance(states, dict) else None
    if not isinstance(saved, list) or states.get("world_size") != len(saved) \
            or isinstance(states.get("world_size"), bool):
        raise CheckpointError(f"{where}: manifest is malformed (states: one entry per saved "
                              "rank)")
    ranks = states.get("ranks")  # a save across some ranks: whose the entries are
    if ranks is not None and (not isinstance(ranks, list) or len(ranks) != len(saved)
                              or len(set(map(repr, ranks))) != len(ranks)
                              or not all(_whole(r) for r in ranks)):
        raise CheckpointError(f"{where}: manifest is malformed (states: ranks, one distinct "
                              "rank per entry)")
    out: list[tuple[str, str | None]] = []
    for r, ref in enumerate(saved):
        if not isinstance(ref, dict):
            raise CheckpointError(f"{where}: manifest is malformed (states entry {r})")
        want = state_files(r)
        for key, name in (("json", ref.get("json")), ("tensors", ref.get("tensors"))):
            if key == "tensors" and name is None:
                continue
            member(folder, name)  # a name that leaves the folder gets its own message first
            expected = want[0] if key == "json" else want[1]
            if name != expected:
                raise CheckpointError(f"{where}: the state file of rank {r} is {name!r}, not "
                                      f"{expected!r} (refusing to read it)")
            if name not in manifest["files"]:
                raise CheckpointError(f"{where}: the state file {name!r} of rank {r} is not "
                                      "among the manifest's files (unchecked; refusing it)")
        out.append((ref["json"], ref.get("tensors")))
    return out


def _check_state(folder: str, name: str, tensors: str | None, ckpt: Checkpoint,
                 verify: bool) -> None:
    """A rank's state JSON: data only (see :func:`~distrun_safetensors.statecodec.check_encoded`),
    every tensor it refers to present in its tensors file."""
    files = ckpt.manifest["files"]
    state = read_json(folder, name, "state", files[name], verify, ckpt.checksum)
    keys = None
    if tensors is not None:
        keys = set(read_header(member(folder, tensors))[0])
    check_encoded(state, os.path.join(folder, name), keys, tensors)
    _check_progress(os.path.join(folder, name), state, ckpt.manifest)


#: the loop's counters in the contributed state, as the core saves them: name -> (counters a
#: resume sets, which of them must be there). All are whole numbers >= 0 but the seed, any
#: whole number; a forged or edited value (a step of -5) would otherwise set the loop to it.
#: (An IterableDataset's ``stream`` state is its DataLoader's own, whose shape depends on the
#: loader and its workers: its loader checks it.)
_COUNTERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "progress": (("epoch", "step", "micro_step", "samples", "batch_idx"), ()),
    "sampler": (("epoch", "cursor", "dataset_len", "batch_size", "seed"),
                ("epoch", "cursor", "dataset_len", "seed")),
}


def _check_progress(where: str, state: Any, manifest: dict[str, Any]) -> None:
    """The loop state of a rank's state file: whole numbers where the loop counts, and the
    step the manifest was committed at."""
    if not isinstance(state, dict):
        raise CheckpointError(f"{where}: state is malformed (an object of named states)")
    for name, (counters, required) in _COUNTERS.items():
        if name not in state:
            continue
        value = state[name]
        if not isinstance(value, dict):
            raise CheckpointError(f"{where}: {name} is {_shown(value)}, not an object of "
                                  "counters (the state was changed after the save)")
        for key in counters:
            if key not in value:
                if key in required:
                    raise CheckpointError(f"{where}: {name}.{key} is missing (the state was "
                                          "changed after the save)")
                continue
            v = value[key]
            whole = isinstance(v, int) and not isinstance(v, bool)
            if not whole or (key != "seed" and v < 0):
                need = "a whole number" if key == "seed" else "a whole number >= 0"
                raise CheckpointError(f"{where}: {name}.{key} is {_shown(v)}, not {need} (the "
                                      "state was changed after the save)")
    step = state.get("progress", {}).get("step") if isinstance(state.get("progress"),
                                                                dict) else None
    recorded = manifest.get("progress")
    saved = recorded.get("step") if isinstance(recorded, dict) else None
    if step is not None and isinstance(saved, int) and step != saved:
        raise CheckpointError(f"{where}: progress.step is {step} but the manifest was committed "
                              f"at step {saved} (the state was changed after the save)")


def _shown(value: Any) -> str:
    return repr(value)[:40]


# -- the indexes -----------------------------------------------------------------------------------


def _check_index(folder: str, name: str, index: dict[str, Any],
                 manifest: dict[str, Any], whole: bool = True) -> dict[str, dict[str, Any]]:
    where = os.path.join(folder, name)
    files = manifest["files"]
    metadata, section = index.get("metadata"), index.get("distrun")
    if not isinstance(index.get("weight_map"), dict) or not isinstance(section, dict):
        raise CheckpointError(f"{where}: index has no weight_map or distrun section")
    if isinstance(metadata, dict) and "format_version" in metadata:
        check_version(where, metadata["format_version"], "index format_version")
    if "version" in section:
        check_version(where, section["version"], "index version")
    for key, fname in index["weight_map"].items():
        if fname not in files:
            member(folder, fname)  # a path that escapes gets its own message first
            raise CheckpointError(f"{where}: weight_map entry {key!r} names {fname!r}, which "
                                  "is not a file of this checkpoint")
    tensors = section.get("tensors")
    if not isinstance(tensors, dict):
        raise CheckpointError(f"{where}: distrun.tensors is missing")
    for tname, info in tensors.items():
        check_tensor(where, tname, info, files, whole)
    total = sum(_prod(info["shape"]) * DTYPE_SIZES[info["dtype"]] for info in tensors.values())
    if isinstance(metadata, dict) and metadata.get("total_size", total) != total:
        raise CheckpointError(f"{where}: metadata.total_size is {metadata['total_size']!r} but "
                              f"its tensors hold {total} bytes")
    record = manifest.get(TENSORS, {}).get(name) if isinstance(manifest.get(TENSORS),
                                                                 dict) else None
    if record is not None:  # the commit's record of dtypes and shapes (absent in older ones)
        _against_record(where, tensors, record)
    return tensors


def _against_record(where: str, tensors: dict[str, Any], record: Any) -> None:
    """The index's tensors are the ones the commit recorded, with the same dtypes and shapes:
    a header and an index edited alike still disagree with the manifest."""
    if not isinstance(record, dict):
        raise CheckpointError(f"{where}: the manifest's record of its tensors is malformed")
    for tname, info in tensors.items():
        got = f"{info['dtype']}{info['shape']}"
        if record.get(tname) != got:
            said = record.get(tname)
            raise CheckpointError(
                f"{where}: tensor {tname!r} is {got} but the manifest recorded "
                + (f"{said} at the commit" if said is not None else "no such tensor")
                + " (the index and its files were changed after the save)")
    missing = [t for t in record if t not in tensors]
    if missing:
        raise CheckpointError(f"{where}: tensor {missing[0]!r} recorded by the manifest is not "
                              "in the index (the index was changed after the save)")


def check_tensor(where: str, name: str, info: Any, files: dict[str, Any],
                 whole: bool = True) -> None:
    """One tensor of an index: a known dtype, a shape, pieces that tile it exactly (not
    ``whole``: pieces inside it that never overlap, a node's part)."""
    bad = f"{where}: tensor {name!r}"
    if not (isinstance(info, dict) and isinstance(info.get("dtype"), str)
            and info["dtype"] in DTYPE_SIZES
            and isinstance(info.get("shape"), list)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                    for d in info["shape"])
            and isinstance(info.get("pieces"), list)):
        raise CheckpointError(f"{bad} is described badly (dtype, shape or pieces)")
    shape = info["shape"]
    numel = _prod(shape)
    covered = 0
    boxes = []
    for piece in info["pieces"]:
        if not (isinstance(piece, dict) and piece.get("file") in files
                and isinstance(piece.get("key"), str)
                and _int_list(piece.get("offsets"), len(shape))
                and _int_list(piece.get("shape"), len(shape))):
            raise CheckpointError(f"{bad} has a malformed piece {str(piece)[:200]}")
        box = list(zip(piece["offsets"], piece["shape"], strict=False))
        if any(o < 0 or o + s > g for (o, s), g in zip(box, shape, strict=False)):
            raise CheckpointError(f"{bad}: piece {piece['key']!r} lies outside shape {shape}")
        covered += _prod(piece["shape"])
        boxes.append(box)
    if covered != numel and (whole or covered > numel):
        raise CheckpointError(f"{bad}: its pieces hold {covered} of {numel} elements")
    if len(boxes) <= 256:
        for i, a in enumerate(boxes):
            for b in boxes[:i]:
                if all(x[0] < y[0] + y[1] and y[0] < x[0] + x[1] for x, y in zip(a, b, strict=False)) \
                        and _prod([s for _, s in a]) and _prod([s for _, s in b]):
                    raise CheckpointError(f"{bad}: two pieces overlap")


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _int_list(value: Any, n: int) -> bool:
    return isinstance(value, list) and len(value) == n and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)


def _prod(values: Any) -> int:
    out = 1
    for v in values:
        out *= v
    return out


# -- optimizer.json --------------------------------------------------------------------------------


def _check_optimizer(where: str, meta: dict[str, Any], optim: dict[str, Any]) -> None:
    """Parameter groups of named parameters and plain values; per-parameter state whose
    tensors are all in the optimizer index (what the loader reads, and nothing else)."""
    groups = meta.get("param_groups")
    if not isinstance(groups, list) or not all(
            isinstance(g, dict) and isinstance(g.get("params"), list)
            and all(isinstance(p, str) for p in g["params"]) for g in groups):
        raise CheckpointError(f"{where}: param_groups is malformed (a list of groups, each "
                              "with the names of its parameters)")
    for i, group in enumerate(groups):
        values = {k: v for k, v in group.items() if k != "params"}
        check_encoded(values, f"{where}: param_groups[{i}]", None, None)
    state = meta.get("state", {})
    if not isinstance(state, dict) or not all(isinstance(v, dict) for v in state.values()):
        raise CheckpointError(f"{where}: state is malformed (parameter name -> its state)")
    for pname, entry in state.items():
        for skey, value in entry.items():
            if isinstance(value, dict) and set(value) == {"__tensor__"}:
                if value["__tensor__"] not in optim:
                    raise CheckpointError(f"{where}: state {pname}.{skey} refers to tensor "
                                          f"{str(value['__tensor__'])[:200]!r}, which the "
                                          "optimizer index does not hold")
            else:
                check_encoded(value, f"{where}: state {pname}.{skey}", None, None)
