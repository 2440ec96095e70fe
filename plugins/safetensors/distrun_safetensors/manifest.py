"""The checkpoint folder: names, the manifest and indexes, validation, discovery. Torch-free.

See ``plugins/safetensors/FORMAT.md`` for the format these functions read and write.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from distrun_safetensors.checksums import checksum
from distrun_safetensors.errors import CheckpointError, NewerFormatError
from distrun_safetensors.paths import GENERATION_FILE, member, read_member

__all__ = ["FORMAT", "VERSION", "Checkpoint", "best_candidates", "candidates", "check_version",
           "inside", "manifest_generation", "monitor_record", "outside_links",
           "read_generation_file", "read_json", "read_latest", "read_manifest", "read_pointer"]

FORMAT = "distrun-safetensors"
#: 2: files are checked with CRC-32C (the manifest's ``checksum``); 1: zlib's CRC-32
VERSION = 2
MANIFEST = "manifest.json"
MODEL_INDEX = "model.safetensors.index.json"
OPTIM_INDEX = "optimizer.safetensors.index.json"
OPTIM_JSON = "optimizer.json"
LATEST = "latest"
#: names the checkpoint with the best monitored value (``--ckpt-monitor``), updated like LATEST
BEST = "best"
#: the manifest key recording the monitored metric of a checkpoint
MONITOR = "monitor"
#: the manifest key recording, per index file, each tensor's ``"<dtype>[<shape>]"``
TENSORS = "tensors"
#: the manifest key recording the generation of the start that committed it (see fence.py)
GENERATION = "generation"
#: ... and the rendezvous round it ran in (``run.generation``: 0 outside the elastic agent)
RDZV_GENERATION = "rdzv_generation"
#: the key of the run that committed a checkpoint (optional; see FORMAT.md)
RUN = "run"
#: the manifest key of one node's part of a memory checkpoint of a state sharded across nodes,
#: ``{"world": W}`` (the world size of the save it is a part of): its pieces do not tile the
#: tensors, and only the memory tier's resume reads it (see replica.py)
PART = "part"
STEP_RE = re.compile(r"^step-(\d+)$")
#: a checkpoint moved aside while a save of the same step replaces it (a kill -9 in between
#: leaves it as the newest valid one; the next commit removes it)
_ASIDE_RE = re.compile(r"^\.old-step-(\d+)-[0-9a-f]{8}$")
_JSON_LIMIT = 256 * 1024 * 1024


def data_file(kind: str, rank: int, world: int) -> str:
    return f"{kind}-{rank + 1:05d}-of-{world:05d}.safetensors"


def state_files(rank: int) -> tuple[str, str]:
    return f"state-{rank:05d}.json", f"state-{rank:05d}.safetensors"


@dataclass
class Checkpoint:
    """A validated checkpoint folder: manifest, tensor indexes and optimizer description."""

    folder: str
    manifest: dict[str, Any]
    model: dict[str, dict[str, Any]] = field(default_factory=dict)
    optim: dict[str, dict[str, Any]] = field(default_factory=dict)
    optimizer: dict[str, Any] | None = None
    #: per saved rank: (its state JSON file, its state tensors file or None)
    states: list[tuple[str, str | None]] = field(default_factory=list)

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def world_size(self) -> int:
        return int(self.manifest["world_size"])

    @property
    def checksum(self) -> str:
        """The name of the checksum each file entry of the manifest carries (version 1
        manifests have none: they used zlib's CRC-32)."""
        return str(self.manifest.get("checksum") or "crc32")

    def path(self, name: str) -> str:
        return member(self.folder, name)


# -- reading the small JSON files ----------------------------------------------------------------


def read_json(folder: str, name: str, what: str, expect: dict[str, Any] | None = None,
              verify: bool = True, algorithm: str = "crc32") -> Any:
    """The JSON object in file ``name`` of ``folder`` (read through
    :func:`~distrun_safetensors.paths.read_member`), checked against the manifest's ``expect``
    (``{"size", <algorithm>}``) first; :class:`CheckpointError` naming the file otherwise."""
    path = os.path.join(folder, name)
    try:
        data = read_member(folder, name, _JSON_LIMIT, what)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: {what} is missing") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read {what} ({exc.strerror})") from None
    if expect is not None:
        if len(data) != expect.get("size"):
            raise CheckpointError(f"{path}: {what} is {len(data)} bytes, the manifest says "
                                  f"{expect.get('size')} (truncated or replaced)")
        if verify and checksum(data, algorithm) != expect.get(algorithm):
            raise CheckpointError(f"{path}: checksum mismatch (corrupted {what})")
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, ValueError):
        raise CheckpointError(f"{path}: {what} is not valid JSON (corrupted)") from None
    except RecursionError:
        raise CheckpointError(f"{path}: {what} is nested too deeply to be one") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: {what} is not a JSON object")
    return obj


def check_version(path: str, version: Any, what: str = "format version") -> None:
    """Refuse a version this build does not read: malformed, or newer than :data:`VERSION`
    (:class:`NewerFormatError`, which ``latest``/``auto`` never skip)."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise CheckpointError(f"{path}: {what} {str(version)[:40]!r} is not a version number "
                              f"(this build reads 1 to {VERSION})")
    if version > VERSION:
        raise NewerFormatError(
            f"{path}: {what} {version} was written by a newer distrun-safetensors; this build "
            f"reads versions 1 to {VERSION} (pip install -U distrun-safetensors)")


def read_manifest(folder: str) -> dict[str, Any]:
    """The manifest of ``folder``; a folder without one is a torn or foreign save."""
    if not os.path.isdir(folder):
        raise CheckpointError(f"{folder}: not a checkpoint folder (no such directory)")
    path = os.path.join(folder, MANIFEST)
    if not os.path.lexists(path):
        raise CheckpointError(f"{path} is missing: {folder} is not a committed checkpoint "
                              "(a torn save or another tool's folder)")
    manifest = read_json(folder, MANIFEST, "manifest")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a {FORMAT} manifest")
    check_version(path, manifest.get("version"))
    files = manifest.get("files")
    ok = (isinstance(files, dict) and isinstance(manifest.get("step"), int)
          and not isinstance(manifest["step"], bool) and manifest["step"] >= 0
          and isinstance(manifest.get("world_size"), int) and manifest["world_size"] >= 1
          and all(isinstance(v, dict) and isinstance(v.get("size"), int) for v in files.values()))
    if not ok:
        raise CheckpointError(f"{path}: manifest is malformed (files, step or world_size)")
    when = manifest.get("committed_at", 0)
    if isinstance(when, bool) or not isinstance(when, (int, float)) or not 0 <= when < 1e11:
        raise CheckpointError(f"{path}: manifest is malformed (committed_at {str(when)[:40]!r} "
                              "is not a time in seconds)")
    for key in (GENERATION, RDZV_GENERATION):
        value = manifest.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CheckpointError(f"{path}: manifest is malformed ({key} {str(value)[:40]!r} "
                                  "is not a whole number >= 0)")
    for name in files:
        member(folder, name)
    return manifest


def manifest_generation(manifest: dict[str, Any] | None) -> int:
    """The generation a manifest records (0: none, or written before generations)."""
    value = (manifest or {}).get(GENERATION, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def read_generation_file(ckpt_dir: str) -> int:
    """The newest generation drawn in ``ckpt_dir`` (0 when the file is missing or unreadable:
    the fence then relies on the checkpoint ``latest`` names)."""
    if not os.path.lexists(os.path.join(ckpt_dir, GENERATION_FILE)):
        return 0
    try:
        record = json.loads(read_member(ckpt_dir, GENERATION_FILE, 4096, "generation file"))
    except (OSError, ValueError, CheckpointError):
        return 0
    return manifest_generation(record if isinstance(record, dict) else None)


# -- discovery -----------------------------------------------------------------------------------


def read_latest(ckpt_dir: str) -> tuple[str | None, str | None]:
    """(folder named by ``latest``, problem) -- either may be None."""
    return read_pointer(ckpt_dir, LATEST)


def read_pointer(ckpt_dir: str, name: str) -> tuple[str | None, str | None]:
    """(folder named by the pointer file ``name`` (``latest``, ``best``), problem) -- either
    may be None."""
    path = os.path.join(ckpt_dir, name)
    if not os.path.lexists(path):
        return None, None
    try:
        target = read_member(ckpt_dir, name, 256, "the pointer").decode().strip()
    except CheckpointError as exc:
        return None, str(exc)
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"{path} is unreadable ({exc})"
    if not STEP_RE.match(target):
        return None, f"{path} does not name a step-N folder ({target[:40]!r})"
    return os.path.join(ckpt_dir, target), None


def read_manifest_quietly(folder: str) -> dict[str, Any] | None:
    """The parsed manifest of ``folder``, or None when it is missing or unreadable (listing
    and retention only: loading validates)."""
    try:
        manifest = json.loads(read_member(folder, MANIFEST, _JSON_LIMIT))
    except (OSError, ValueError, RecursionError, CheckpointError):
        return None
    return manifest if isinstance(manifest, dict) else None


def monitor_record(manifest: dict[str, Any] | None) -> dict[str, Any] | None:
    """The manifest's monitored metric ``{"name", "mode", "value", "step"}`` (written by
    ``--ckpt-monitor``), or None when it has none or it is malformed."""
    record = (manifest or {}).get(MONITOR)
    if not isinstance(record, dict):
        return None
    value = record.get("value")
    if not (isinstance(record.get("name"), str) and record.get("mode") in ("min", "max")
            and isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value)):
        return None
    return record


def rank_records(records: list[tuple[str, dict[str, Any]]], name: str,
                 mode: str) -> list[tuple[str, dict[str, Any]]]:
    """``(folder, record)`` pairs of metric ``name`` and ``mode``, best first (ties: the
    earlier step first)."""
    mine = [(f, r) for f, r in records if r["name"] == name and r["mode"] == mode]
    sign = 1.0 if mode == "min" else -1.0
    return sorted(mine, key=lambda fr: (sign * fr[1]["value"], fr[1].get("step", 0)))


def best_candidates(ckpt_dir: str) -> tuple[list[str], list[str]]:
    """(folders to try for ``best``: the one ``best`` names, then the others that carry a
    value of the same monitored metric, best value first; notes about ``best``)."""
    notes = outside_links(ckpt_dir)
    named, problem = read_pointer(ckpt_dir, BEST)
    if problem:
        notes.append(problem)
    records = []
    for folder in step_folders(ckpt_dir):
        record = monitor_record(read_manifest_quietly(folder))
        if record is not None:
            records.append((folder, record))
    if named is not None and not inside(ckpt_dir, named):
        named = None
    if named is not None and not os.path.isdir(named):
        notes.append(f"{os.path.join(ckpt_dir, BEST)} names {os.path.basename(named)}, which "
                     "does not exist")
        named = None
    # the metric to rank by: the one the named folder carries, else the newest record's
    ref = next((r for f, r in records if named and f == named), None)
    if ref is None and records:
        ref = records[0][1]
    order = [f for f, _ in rank_records(records, ref["name"], ref["mode"])] if ref else []
    if named is not None:
        order = [named] + [f for f in order if f != named]
    return order, notes


def inside(ckpt_dir: str, folder: str) -> bool:
    """True when ``folder`` (a ``step-N`` entry of ``ckpt_dir``) really lies in ``ckpt_dir``."""
    return os.path.dirname(os.path.realpath(folder)) == os.path.realpath(ckpt_dir)


def outside_links(ckpt_dir: str) -> list[str]:
    """Notes on ``step-N`` entries of ``ckpt_dir`` that are links out of it (never read)."""
    try:
        names = sorted(n for n in os.listdir(ckpt_dir) if STEP_RE.match(n))
    except OSError:
        return []
    return [f"{os.path.join(ckpt_dir, n)} is a link that leaves {ckpt_dir} (not read; "
            "give it to --resume PATH itself to load it)"
            for n in names if not inside(ckpt_dir, os.path.join(ckpt_dir, n))]


def _commit_order(folder: str) -> tuple[int, float, bool, int]:
    """Sort key of a step folder: its generation, then its commit time (within a generation,
    one start of the run: its newest step), a folder before its moved-aside copy, the step."""
    manifest = read_manifest_quietly(folder)  # never through a link that leaves
    when = (manifest or {}).get("committed_at", -1.0)
    if isinstance(when, bool) or not isinstance(when, (int, float)):
        when = -1.0
    name = os.path.basename(folder)
    m = STEP_RE.match(name) or _ASIDE_RE.match(name)
    return (manifest_generation(manifest), float(when), not name.startswith("."),
            int(m.group(1)) if m else -1)


def step_folders(ckpt_dir: str) -> list[str]:
    """``step-N`` folders of ``ckpt_dir``, newest first: newest generation, then newest commit;
    links out of it are left out."""
    try:
        names = [n for n in os.listdir(ckpt_dir) if STEP_RE.match(n) or _ASIDE_RE.match(n)]
    except OSError:
        return []
    folders = [os.path.join(ckpt_dir, n) for n in names
               if os.path.isdir(os.path.join(ckpt_dir, n))
               and inside(ckpt_dir, os.path.join(ckpt_dir, n))]
    keys = {f: _commit_order(f) for f in folders}
    return sorted(folders, key=keys.__getitem__, reverse=True)


def candidates(ckpt_dir: str) -> tuple[list[str], list[str]]:
    """(folders to try in order, notes about ``latest``): the newest generation first, and
    within it ``latest`` first, then the newest commits (``latest`` names the newest
    generation's newest checkpoint unless a commit was cut short)."""
    notes = outside_links(ckpt_dir)
    latest, problem = read_latest(ckpt_dir)
    if problem:
        notes.append(problem)
    order = step_folders(ckpt_dir)
    if latest is not None and not inside(ckpt_dir, latest):
        latest = None  # a link out of the folder: said in the notes above
    if latest is not None:
        if os.path.isdir(latest):
            rest = [f for f in order if f != latest]
            named = read_manifest_quietly(latest)
            at = 0  # unreadable: tried first, so the warning says what is wrong with it
            if named is not None:
                mine = manifest_generation(named)
                at = next((i for i, f in enumerate(rest)
                           if manifest_generation(read_manifest_quietly(f)) <= mine), len(rest))
            order = rest[:at] + [latest] + rest[at:]
        else:
            notes.append(f"{os.path.join(ckpt_dir, LATEST)} names {os.path.basename(latest)}, "
                         "which does not exist")
    return order, notes


def is_checkpoint_folder(path: str) -> bool:
    return os.path.exists(os.path.join(path, MANIFEST)) or bool(
        STEP_RE.match(os.path.basename(os.path.normpath(path))))
