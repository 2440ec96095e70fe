"""Rank 0's part of a save: the commit record, then the compare-and-swap that publishes it.

The ranks have written and synced their files into ``.tmp-step-N-<id>/`` and reported them;
:func:`write_record` writes the indexes, ``optimizer.json`` and last the manifest (which records
this start's generation) and syncs the folder. :func:`commit` then takes the folder's commit
lock and, unless a newer generation took over (:mod:`~distrun_safetensors.fence`), renames the
folder to ``step-N`` and replaces ``latest`` (and ``best``). See FORMAT.md, commit protocol.
Torch-free.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import Any

from distrun.plugin import ProcessId
from distrun_safetensors.checksums import DEFAULT as CHECKSUM
from distrun_safetensors.fence import CommitLock, LockLost, fenced_error, find_stale
from distrun_safetensors.files import (
    DTYPE_SIZES,
    CheckpointError,
    durable,
    fsync_dir,
    write_json,
)
from distrun_safetensors.leftovers import discard
from distrun_safetensors.manifest import (
    FORMAT,
    GENERATION,
    LATEST,
    MANIFEST,
    MODEL_INDEX,
    OPTIM_INDEX,
    OPTIM_JSON,
    PART,
    RDZV_GENERATION,
    TENSORS,
    VERSION,
)
from distrun_safetensors.retention import Retention, add_record, point_best, replace_pointer
from distrun_safetensors.validation import check_tensor

__all__ = ["commit", "tag", "write_record"]

log = logging.getLogger("distrun")

#: times a commit takes the lock again after losing it (only to a holder frozen past its age)
_ATTEMPTS = 3


def write_record(job: dict[str, Any], reports: list[dict[str, Any]], tmp: str,
                 generation: int, rdzv_generation: int) -> None:
    """Write the indexes, ``optimizer.json`` and the manifest into ``tmp``, synced."""
    files: dict[str, Any] = {}
    indexes: dict[str, dict[str, Any]] = {"model": {}, "optim": {}}
    for r in reports:
        files.update(r["files"])
        for kind in ("model", "optim"):
            for name, desc in r["pieces"][kind].items():
                entry = indexes[kind].setdefault(name, {**desc["tensor"], "pieces": []})
                entry["pieces"].extend(desc["pieces"])
    order = {name: i for i, name in enumerate(job["order"])}
    indexes["model"] = dict(sorted(indexes["model"].items(),
                                   key=lambda kv: order.get(kv[0], len(order))))
    part = job.get("part_of", 0)  # a node's part: its pieces do not tile the tensors
    for kind in ("model", "optim"):
        for name, info in indexes[kind].items():
            check_tensor(f"{kind} pieces", name, info, files, whole=not part)
    if job["optim_meta"] is not None:
        files[OPTIM_JSON] = write_json(os.path.join(tmp, OPTIM_JSON), job["optim_meta"])
    record: dict[str, dict[str, str]] = {}
    for kind, name in (("model", MODEL_INDEX), ("optim", OPTIM_INDEX)):
        if kind == "optim" and job["optim_meta"] is None:
            continue
        files[name] = write_json(os.path.join(tmp, name), _hf_index(indexes[kind]))
        record[name] = {t: f"{info['dtype']}{info['shape']}" for t, info in indexes[kind].items()}
    manifest = {
        "format": FORMAT, "version": VERSION, "step": job["step"], "reason": job["reason"],
        "committed_at": time.time(), "world_size": job["world"],
        "meshes": job["meshes"], "checksum": CHECKSUM, "files": files,
        "states": {"world_size": job["world"], "files": [r["state_files"] for r in reports],
                   # a save across some ranks (one node's): whose states these are, in order
                   **({"ranks": list(job["members"])} if job.get("members") else {})},
        TENSORS: record, GENERATION: generation, RDZV_GENERATION: rdzv_generation,
        **({PART: {"world": part}} if part else {}), **job["info"],
    }
    write_json(os.path.join(tmp, MANIFEST), manifest)
    fsync_dir(tmp)
    durable("tmp folder synced")


def commit(directory: str, step: int, tmp: str, final: str, generation: int,
           retention: Retention | None, stale_after: float) -> None:
    """Publish ``tmp`` as ``final`` under the commit lock, or raise
    :class:`~distrun_safetensors.errors.FencedError` when a newer generation took over."""
    for _ in range(_ATTEMPTS):
        with CommitLock(directory, stale_after) as lock:
            try:
                aside = _publish(directory, lock, generation, step, tmp, final, retention)
            except LockLost:
                continue
        if aside is not None:
            discard(aside)  # a fallback for readers until it goes: never half-deleted
        return
    raise CheckpointError(f"the commit lock of {directory} was taken from this process "
                          f"{_ATTEMPTS} times (frozen for longer than {stale_after:g} s each "
                          "time)")


def _publish(directory: str, lock: CommitLock, generation: int, step: int, tmp: str,
             final: str, retention: Retention | None) -> str | None:
    """The compare-and-swap: unless a newer generation took over, rename ``tmp`` to ``final``
    and point ``latest`` (and ``best``) at it. Returns the committed folder ``final`` replaced,
    moved aside (the caller removes it once the lock is released)."""
    stale = find_stale(directory, generation, step)
    if stale is not None:
        raise fenced_error(stale, generation, step, directory)
    launcher = ProcessId.launcher()
    if launcher is not None and not launcher.alive():  # an orphan (its launcher was killed) never commits
        raise CheckpointError("the launcher is gone: this run was stopped")
    lock.ensure()
    aside = None
    if os.path.exists(final):  # same step saved before (e.g. a resumed run): replace it
        aside = os.path.join(directory, f".old-{os.path.basename(final)}-{uuid.uuid4().hex[:8]}")
        os.rename(final, aside)
        durable("moved aside")
    os.rename(tmp, final)
    fsync_dir(directory)
    durable("renamed")
    try:
        lock.ensure()
    except LockLost:  # undo, then try again under the lock (the fence is checked anew)
        os.rename(final, tmp)
        if aside is not None:
            os.rename(aside, final)
        fsync_dir(directory)
        raise
    try:
        replace_pointer(directory, LATEST, os.path.basename(final))
    except OSError:  # no room for the new pointer: put the folder back, as before the save
        os.rename(final, tmp)
        if aside is not None:
            os.rename(aside, final)
        fsync_dir(directory)
        raise
    if retention is not None:
        try:
            point_best(directory, retention)
        except OSError as exc:  # the save is committed (latest names it): not a failed save
            log.warning("checkpoint: %s is committed but best could not be moved to %s (%s); "
                        "it moves at the next save that has room", final, retention.best,
                        exc.strerror or exc)
    return aside


def tag(directory: str, folder: str, record: dict[str, Any], retention: Retention | None,
        generation: int, stale_after: float) -> None:
    """Record the monitored value in the committed ``folder`` and move ``best``, under the
    commit lock and the same fence as a commit."""
    with CommitLock(directory, stale_after):
        stale = find_stale(directory, generation)
        if stale is not None:
            raise fenced_error(stale, generation, record.get("step", 0), directory)
        add_record(directory, folder, record)
        if retention is not None:
            point_best(directory, retention)


def _hf_index(tensors: dict[str, dict[str, Any]]) -> dict[str, Any]:
    total = 0
    weight_map = {}
    for info in tensors.values():
        numel = 1
        for d in info["shape"]:
            numel *= d
        total += numel * DTYPE_SIZES[info["dtype"]]
        info["pieces"].sort(key=lambda p: p["offsets"])
        for p in info["pieces"]:
            weight_map[p["key"]] = p["file"]
    return {"metadata": {"total_size": total, "format": FORMAT, "format_version": VERSION},
            "weight_map": weight_map,
            "distrun": {"version": VERSION, "tensors": tensors}}
