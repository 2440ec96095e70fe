"""``distrun ckpt inspect | verify | consolidate | ls | clean``. Torch-free except
``consolidate``.

Every command takes a checkpoint folder, a ``latest``/``best`` pointer file (followed, read
through the checked open), a checkpoints folder or a run folder.
"""

from __future__ import annotations

import datetime
import json
import os
import re
from typing import Any

import click

from distrun_safetensors.errors import CheckpointError, NewerFormatError
from distrun_safetensors.files import DTYPE_SIZES
from distrun_safetensors.leftovers import find_leftovers, find_trash, remove_trash
from distrun_safetensors.leftovers import remove as remove_leftover
from distrun_safetensors.manifest import (
    BEST,
    LATEST,
    MODEL_INDEX,
    candidates,
    inside,
    is_checkpoint_folder,
    monitor_record,
    outside_links,
    rank_records,
    read_latest,
    read_manifest_quietly,
    read_pointer,
    step_folders,
)
from distrun_safetensors.validation import validate

__all__ = ["ckpt"]

_TRASH_WHY = "a pruned checkpoint whose removal was cut short (never read)"


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return str(n)


def parse_size(text: str) -> int:
    """'2GB' -> 2e9, '512MiB' -> 512 * 2**20, '1000' -> 1000 bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?)(i?)B?\s*", text,
                     flags=re.IGNORECASE)
    if not m or (m.group(3) and not m.group(2)):
        raise click.BadParameter(f"{text!r} is not a size (examples: 2GB, 500MB, 1GiB)")
    base = 1024 if m.group(3) else 1000
    power = " KMGT".index(m.group(2).upper() or " ")
    size = int(float(m.group(1)) * base ** power)
    if size < 1:
        raise click.BadParameter(f"{text!r} is too small: a shard holds at least one byte")
    return size


def _when(manifest: dict[str, Any]) -> str:
    """The manifest's commit time (validated to be a number of seconds) as an ISO date."""
    try:
        return datetime.datetime.fromtimestamp(manifest.get("committed_at", 0)).isoformat(
            timespec="seconds")
    except (OverflowError, OSError, ValueError, TypeError):
        return "?"


def _pointer(path: str) -> str | None:
    """The folder a ``latest`` or ``best`` pointer file names (read through the checked open,
    the folder inside the pointer's own folder); None when ``path`` is no pointer file."""
    name = os.path.basename(os.path.normpath(path))
    if name not in (LATEST, BEST) or os.path.isdir(path):
        return None
    directory = os.path.dirname(os.path.abspath(path))
    folder, problem = read_pointer(directory, name)
    if problem or folder is None:
        raise CheckpointError(problem or f"{path} is not a pointer file")
    if not inside(directory, folder):
        raise CheckpointError(f"{path} names {os.path.basename(folder)}, a link that leaves "
                              f"{directory} (not followed; give that folder itself)")
    if not os.path.isdir(folder):
        raise CheckpointError(f"{path} names {os.path.basename(folder)}, which does not exist")
    return os.path.join(os.path.dirname(path), os.path.basename(folder))


def _checkpoints(path: str) -> str:
    """The checkpoints folder of PATH: PATH itself, its ``checkpoints`` (a run folder), or
    the folder holding PATH when PATH is one checkpoint or a pointer."""
    if _pointer(path) is not None or is_checkpoint_folder(path):
        return os.path.dirname(os.path.normpath(path)) or "."
    nested = os.path.join(path, "checkpoints")
    if os.path.isdir(nested) and not step_folders(path) and not os.path.lexists(
            os.path.join(path, LATEST)):
        return nested
    return path


def _folder(path: str) -> str:
    """A checkpoint folder: PATH itself, the one a ``latest``/``best`` pointer PATH names, or
    what ``latest`` (or the newest) names in PATH (a checkpoints or run folder)."""
    named = _pointer(path)
    if named is not None:
        return named
    if is_checkpoint_folder(path):
        return path
    directory = _checkpoints(path)
    folders, _ = candidates(directory)
    if not folders:
        raise CheckpointError(f"no checkpoint in {directory}")
    return folders[0]


@click.group("ckpt")
def ckpt() -> None:
    """Inspect, verify, list and consolidate distrun-safetensors checkpoints."""


@ckpt.command("inspect")
@click.argument("path", type=click.Path(exists=True))
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--verify", is_flag=True,
              help="also check every file's checksum (reads every byte, as `ckpt verify`)")
def inspect_cmd(path: str, as_json: bool, verify: bool) -> None:
    """Step, layout and every tensor (dtype, shape, size, pieces) of a checkpoint.

    Reads the metadata only (manifest, indexes, headers, sizes, state files) unless
    ``--verify``: flipped bytes in tensor data are found by ``distrun ckpt verify``.
    """
    c = validate(_folder(path), verify=verify)
    m = c.manifest
    if as_json:
        click.echo(json.dumps({"folder": c.folder, "checksums_verified": verify, "manifest": m,
                               "model": c.model, "optimizer": c.optim}, indent=1))
        return
    when = _when(m)
    total = sum(f["size"] for f in m["files"].values())
    click.echo(f"checkpoint {c.folder}")
    click.echo(f"  step {m['step']}  reason {m.get('reason')}  saved {when}  round "
               f"{m.get('generation', 0)} (rendezvous round {m.get('rdzv_generation', 0)})")
    click.echo(f"  saved by {m['world_size']} rank(s), strategy {m.get('strategy')}, "
               f"meshes {m.get('meshes') or 'none'}")
    checked = ("checksums verified" if verify else
               f"metadata checked, data not verified: run `distrun ckpt verify {path}`")
    click.echo(f"  {len(m['files'])} files, {_human(total)}; {checked}")
    record = monitor_record(m)
    if record is not None:
        click.echo(f"  monitored {record['name']}={record['value']:.6g} ({record['mode']}, "
                   f"logged at step {record.get('step')})")
    for title, tensors in (("model", c.model), ("optimizer state", c.optim)):
        if not tensors:
            continue
        size = sum(_nbytes(i) for i in tensors.values())
        click.echo(f"{title}: {len(tensors)} tensors, {_human(size)}")
        width = max(len(n) for n in tensors)
        for name, info in tensors.items():
            click.echo(f"  {name:<{width}}  {info['dtype']:<5} {str(info['shape']):<16} "
                       f"{_human(_nbytes(info)):>10}  {len(info['pieces'])} piece(s)  "
                       f"{info.get('layout', '')}")


def _nbytes(info: dict[str, Any]) -> int:
    n = DTYPE_SIZES[info["dtype"]]
    for d in info["shape"]:
        n *= d
    return n


@ckpt.command("verify")
@click.argument("path", type=click.Path(exists=True))
def verify_cmd(path: str) -> None:
    """Check a checkpoint as a resume does (manifest, versions, indexes, headers, state files,
    checksums): one folder (or what a pointer names), or every one of a checkpoints folder."""
    one = _pointer(path) or (path if is_checkpoint_folder(path) else None)
    if one is not None:  # one checkpoint: its first problem is the error line
        c = validate(one, verify=True)
        total = sum(f["size"] for f in c.manifest["files"].values())
        click.echo(f"OK  {one}: step {c.step}, {len(c.manifest['files'])} files, "
                   f"{_human(total)} verified")
        return
    directory = _checkpoints(path)
    folders, notes = candidates(directory)
    for note in notes:
        click.echo(f"warning: {note}")
    if not folders:
        raise CheckpointError(f"no checkpoint in {directory}")
    bad = 0
    for folder in folders:
        try:
            c = validate(folder, verify=True)
        except CheckpointError as exc:
            bad += 1
            click.echo(f"BAD {folder}: {exc}")
            continue
        total = sum(f["size"] for f in c.manifest["files"].values())
        click.echo(f"OK  {folder}: step {c.step}, {len(c.manifest['files'])} files, "
                   f"{_human(total)} verified")
    if bad:
        raise CheckpointError(f"{bad} of {len(folders)} checkpoint(s) failed verification")


_TIMEOUT = click.option(
    "--timeout", type=click.FloatRange(min=0), default=300.0, show_default=True,
    envvar="DISTRUN_TIMEOUT",
    help="seconds after which a save left by another host counts as abandoned (the run's "
         "--timeout; DISTRUN_TIMEOUT)")


@ckpt.command("ls")
@click.argument("directory", type=click.Path(exists=True), default=".")
@_TIMEOUT
def ls_cmd(directory: str, timeout: float) -> None:
    """List the checkpoints of a checkpoint folder (or a run folder), newest first, and the
    saves that never committed."""
    only = _pointer(directory) or (directory if is_checkpoint_folder(directory) else None)
    directory = _checkpoints(directory)
    latest, problem = read_latest(directory)
    notes = outside_links(directory)
    if latest is not None and not os.path.isdir(latest):
        problem = (f"{os.path.join(directory, 'latest')} names {os.path.basename(latest)}, which "
                   "does not exist (--resume latest falls back to the newest valid checkpoint; "
                   "delete the file or point it at one of the folders listed)")
        latest = None
    elif latest is not None and not inside(directory, latest):
        latest = None  # a link out: the note above says so
    folders = step_folders(directory)
    if only is not None:  # one checkpoint: its line alone
        folders, notes, problem = [only], [], None
    for note in notes:
        click.echo(f"warning: {note}", err=True)
    leftovers = find_leftovers(directory, timeout) if only is None else []
    if not folders:
        click.echo(f"no checkpoints in {directory}")
    best, best_problem = read_pointer(directory, BEST)
    ranks = _best_ranks(folders)
    for folder in folders:
        mark = "*" if latest and os.path.realpath(latest) == os.path.realpath(folder) else " "
        try:
            c = validate(folder, verify=False)
            m = c.manifest
            when = _when(m)
            size = sum(f["size"] for f in m["files"].values())
            tail = ranks.get(folder, "")
            if best and os.path.realpath(best) == os.path.realpath(folder):
                tail += "  <- best"
            click.echo(f"{mark} {os.path.basename(folder):<16} step {m['step']:<8} {when}  "
                       f"{_human(size):>10}  {m['world_size']} rank(s)  {m.get('reason')}  "
                       f"round {m.get('generation', 0)}{tail}")
        except NewerFormatError as exc:  # not damaged: this build is older than the writer
            click.echo(f"{mark} {os.path.basename(folder):<16} NEWER FORMAT: {exc}")
        except CheckpointError as exc:
            click.echo(f"{mark} {os.path.basename(folder):<16} DAMAGED: {exc}")
    for left in leftovers:
        state = "ABANDONED" if left.abandoned else "in progress"
        click.echo(f"  {os.path.basename(left.path):<16} step {left.step}  {state}: {left.why}")
    trash = find_trash(directory) if only is None else []
    for path in trash:
        click.echo(f"  {os.path.basename(path):<16} {_TRASH_WHY}")
    abandoned = any(left.abandoned for left in leftovers)
    if abandoned or trash:
        what = " and ".join(w for w, found in (("the abandoned saves", abandoned),
                                               ("the unfinished removals", trash)) if found)
        click.echo(f"(`distrun ckpt clean {directory}` removes {what})")
    if best_problem and only is None:
        click.echo(f"warning: {best_problem}", err=True)
    elif best and not os.path.isdir(best) and only is None:
        click.echo(f"warning: {os.path.join(directory, BEST)} names {os.path.basename(best)}, "
                   "which does not exist (--resume best falls back to the best valid one)",
                   err=True)
    if problem:
        raise CheckpointError(problem)


@ckpt.command("clean")
@click.argument("directory", type=click.Path(exists=True), default=".")
@_TIMEOUT
@click.option("--dry-run", is_flag=True, help="say what would be removed, remove nothing")
def clean_cmd(directory: str, timeout: float, dry_run: bool) -> None:
    """Remove the saves that never committed and whose writer is gone (``.tmp-step-N-*``
    folders and their locks) and the checkpoints whose removal a kill cut short
    (``.pruned-*``); saves still being written are left alone. Checkpoints are never
    touched."""
    directory = _checkpoints(directory)
    leftovers = find_leftovers(directory, timeout)
    trash = find_trash(directory)
    removed = kept = 0
    for path in trash:  # never read by anyone: finishing the removal is always safe
        name = os.path.basename(path)
        if dry_run:
            click.echo(f"would remove {name}: {_TRASH_WHY}")
        elif remove_trash(path):
            click.echo(f"removed {name}: {_TRASH_WHY}")
        else:
            click.echo(f"kept {name}: it could not be removed")
    for left in leftovers:
        name = os.path.basename(left.path)
        if not left.abandoned:
            kept += 1
            click.echo(f"kept {name}: {left.why}")
        elif dry_run:
            removed += 1
            click.echo(f"would remove {name}: {left.why}")
        elif remove_leftover(left.path):
            removed += 1
            click.echo(f"removed {name}: {left.why}")
        else:
            kept += 1
            click.echo(f"kept {name}: its writer came back or it could not be removed")
    verb = "would remove" if dry_run else "removed"
    removals = f", {verb} {len(trash)} unfinished removal(s)" if trash else ""
    click.echo(f"{directory}: {verb} {removed} abandoned save(s), kept {kept} in progress"
               f"{removals}" if leftovers or trash else f"{directory}: nothing to clean")


def _best_ranks(folders: list[str]) -> dict[str, str]:
    """``folder -> "  val_loss=0.31 #1 of top 2"`` for the checkpoints carrying a monitored
    value (ranked among those of the same metric; "top k" as the newest record says)."""
    records = []
    for folder in folders:
        record = monitor_record(read_manifest_quietly(folder))
        if record is not None:
            records.append((folder, record))
    out = {}
    for name, mode in dict.fromkeys((r["name"], r["mode"]) for _, r in records):
        ranked = rank_records(records, name, mode)
        k = next((r.get("top_k") for _, r in records if r["name"] == name), None)
        for i, (folder, record) in enumerate(ranked):
            top = f" #{i + 1} of top {k}" if isinstance(k, int) and i < k else ""
            out[folder] = f"  {name}={record['value']:.6g}{top}"
    return out


@ckpt.command("consolidate")
@click.argument("path", type=click.Path(exists=True))
@click.argument("out", type=click.Path())
@click.option("--max-shard-size", default="2GB", show_default=True,
              help="largest output file (e.g. 500MB, 2GB, 1GiB)")
def consolidate_cmd(path: str, out: str, max_shard_size: str) -> None:
    """Write the model as a standard Hugging Face sharded safetensors folder.

    Streams one tensor at a time: memory stays near the largest tensor.
    """
    from distrun_safetensors.consolidate import consolidate

    index = consolidate(_folder(path), out, parse_size(max_shard_size))
    n = len(set(index["weight_map"].values()))
    click.echo(f"wrote {out}: {len(index['weight_map'])} tensors in {n} file(s), "
               f"{_human(index['metadata']['total_size'])}, index {MODEL_INDEX}")
