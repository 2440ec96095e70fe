"""The memory tier's peer replica: each node's part of a state sharded across nodes, copied into
the next node's memory, and the views a resume reads.

A state sharded across nodes (FSDP over the ranks of every node) leaves each node's memory tier
with its own ranks' *part*: the tensors' pieces its ranks hold (they do not tile the tensors),
the replicated tensors once, and its ranks' states. Its manifest says so (``part``: the world it
is a part of), and only a resume from the tier reads such a folder (the disk's readers refuse
it). After each save every node's first rank sends the node's part to the next node's first
rank (a ring: node k to node k+1, the last to the first), which writes it into ``replica/`` of
its own tier folder, committed by a rename: the launcher owns that folder, so the copy outlives
the worker that received it. The copy goes over gloo point-to-point in chunks, at most
``--ckpt-memory-replica-mb-s`` MB/s each way, in the save's background thread; a step's save is
done once every node holds its own part and its predecessor's, and only then is the step before
it pruned, here and in ``replica/``.

A resume reads a *view* of each step the node committed (:func:`build_views`): its own part
and the replica of the same step, their files linked (not copied) into one folder under the
names a save of the whole world gives them, the indexes and the manifest merged. Over two
nodes the view is the whole checkpoint: the survivors of a lost node re-form from it, at any
world size, without a disk read. Over more, a view holds two nodes' parts: a restart of the
same world reads it (each rank its own shards), and a rank whose shards are in no view of its
node skips the tier for the disk, said once.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from distrun_safetensors.commit import _hf_index
from distrun_safetensors.errors import CheckpointError
from distrun_safetensors.files import write_json
from distrun_safetensors.manifest import (
    GENERATION,
    LATEST,
    MANIFEST,
    MODEL_INDEX,
    OPTIM_INDEX,
    OPTIM_JSON,
    PART,
    RUN,
    TENSORS,
    candidates,
    data_file,
    state_files,
)
from distrun_safetensors.pieces import covered

__all__ = ["Ring", "build_views", "exchange", "replica_dir"]

_REPLICA = "replica"
_CHUNK = 8 << 20


@dataclass(frozen=True)
class Ring:
    """The nodes' first ranks, each sending its node's part to the next: their process group,
    the global ranks this one sends to and receives from, and the cap in MB/s (0: none)."""

    group: Any
    send_to: int
    recv_from: int
    mb_s: float


def replica_dir(tier: str) -> str:
    """Where a node's tier folder keeps the previous node's parts."""
    return os.path.join(tier, _REPLICA)


def exchange(ring: Ring, folder: str, step: int) -> None:
    """Send the committed part ``folder`` (of ``step``) to the next node and receive the
    previous node's part of the same step into ``replica/step-N`` (a node's first rank, each
    node's at once); the replicas of older steps are removed once it is in place."""
    import torch
    import torch.distributed as dist

    mine = [(name, os.path.getsize(os.path.join(folder, name)))
            for name in sorted(os.listdir(folder))]
    told: list[Any] = [None] * dist.get_world_size(ring.group)
    dist.all_gather_object(told, (step, mine), group=ring.group)
    prev_step, theirs = told[dist.get_group_rank(ring.group, ring.recv_from)]
    if prev_step != step:
        raise CheckpointError(f"the previous node sent step {prev_step}, not {step}")
    root = replica_dir(os.path.dirname(folder))
    os.makedirs(root, exist_ok=True)
    for name in os.listdir(root):  # a copy cut short by a fault: never read, removed here
        if name.startswith(".tmp-"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    tmp = os.path.join(root, f".tmp-step-{step}-{uuid.uuid4().hex[:8]}")
    os.mkdir(tmp)
    try:
        outgoing = _chunks(folder, mine)
        sink = _Sink(tmp, theirs)
        n_in = -(-sum(size for _, size in theirs) // _CHUNK)
        n_out = -(-sum(size for _, size in mine) // _CHUNK)
        started, sent = time.monotonic(), 0
        for i in range(max(n_in, n_out)):
            works, buf = [], None
            if i < n_out:
                chunk = next(outgoing)
                sent += len(chunk)
                works.append(dist.isend(torch.frombuffer(chunk, dtype=torch.uint8),
                                        dst=ring.send_to, group=ring.group))
            if i < n_in:
                buf = torch.empty(sink.next_size(), dtype=torch.uint8)
                works.append(dist.irecv(buf, src=ring.recv_from, group=ring.group))
            for work in works:
                work.wait()
            if buf is not None:
                sink.write(memoryview(buf.numpy()))
            if ring.mb_s:  # the cap: no faster than mb_s each way
                ahead = started + max(sent, sink.written) / (ring.mb_s * 1e6) - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)
        sink.close()
        final = os.path.join(root, f"step-{step}")
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for name in os.listdir(root):
        if name.startswith("step-") and name != f"step-{step}":
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _chunks(folder: str, files: list[tuple[str, int]]) -> Iterator[memoryview]:
    """The files' bytes, one after the other, in chunks of ``_CHUNK`` (the last shorter): one
    buffer, read into, each chunk valid until the next is asked for."""
    buf = memoryview(bytearray(_CHUNK))
    used = 0
    for name, size in files:
        with open(os.path.join(folder, name), "rb", buffering=0) as fh:
            left = size
            while left:
                n = fh.readinto(buf[used:used + min(left, _CHUNK - used)])
                if not n:
                    raise CheckpointError(f"{os.path.join(folder, name)} is shorter than "
                                          f"{size} bytes")
                used += n
                left -= n
                if used == _CHUNK:
                    yield buf
                    used = 0
    if used:
        yield buf[:used]


class _Sink:
    """Writes a stream of chunks into the files it holds, one after the other."""

    def __init__(self, folder: str, files: list[tuple[str, int]]) -> None:
        self.folder, self.files = folder, list(files)
        self.total = sum(size for _, size in files)
        self.written = 0
        self._index, self._left, self._fh = -1, 0, None
        self._advance()

    def next_size(self) -> int:
        return min(_CHUNK, self.total - self.written)

    def _advance(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        while self._index + 1 < len(self.files):
            self._index += 1
            name, self._left = self.files[self._index]
            if os.path.basename(name) != name or name.startswith("."):
                raise CheckpointError(f"the previous node sent a file named {name!r}")
            fh = open(os.path.join(self.folder, name), "wb")  # noqa: SIM115 - held
            if self._left:
                self._fh = fh
                return
            fh.close()  # an empty file: made, nothing to write

    def write(self, data: memoryview) -> None:
        self.written += len(data)
        while len(data):
            if self._fh is None:
                raise CheckpointError("the previous node sent more bytes than it announced")
            n = min(self._left, len(data))
            self._fh.write(data[:n])
            data, self._left = data[n:], self._left - n
            if not self._left:
                self._advance()

    def close(self) -> None:
        if self._fh is not None or self.written != self.total:
            raise CheckpointError("the previous node's part ended early")


# -- views ------------------------------------------------------------------------------------


def build_views(tier: str, name: str) -> str | None:
    """A folder ``<tier>/<name>`` of one view per step this node committed (its part and the
    replica of that step), with ``latest`` as the tier's: the folder a resume reads; None when
    the tier holds no parts (its checkpoints are whole: it is read as it is)."""
    folders, _ = candidates(tier)
    parts = [f for f in folders if PART in _manifest(f)]
    if not parts:
        return None
    root = os.path.join(tier, name)
    shutil.rmtree(root, ignore_errors=True)
    try:
        os.makedirs(root)
    except OSError:  # the parts themselves are read then (each rank checks its own pieces)
        return None
    for folder in parts:
        step = os.path.basename(folder)
        copy = os.path.join(replica_dir(tier), step)
        with contextlib.suppress(OSError, ValueError, KeyError, CheckpointError):
            _view(os.path.join(root, step), [folder] + ([copy] if os.path.isdir(copy) else []))
    with contextlib.suppress(OSError):
        shutil.copyfile(os.path.join(tier, LATEST), os.path.join(root, LATEST))
    return root


def _manifest(folder: str) -> dict[str, Any]:
    try:
        with open(os.path.join(folder, MANIFEST), "rb") as fh:
            data = json.loads(fh.read(1 << 24))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _view(target: str, parts: list[str]) -> None:
    """One folder of ``parts`` (the node's own first) of one step: files linked under a whole
    world's names, indexes and manifest merged. A replica of another save (another step, run
    or generation) is left out; a tensor every part holds whole (replicated) is taken from the
    first."""
    base = _manifest(parts[0])
    held = [(parts[0], base)] + [
        (folder, m) for folder, m in ((f, _manifest(f)) for f in parts[1:])
        if PART in m and all(m.get(k) == base.get(k) for k in ("step", GENERATION, RUN))]
    world = int(base[PART]["world"])
    os.makedirs(target)
    files: dict[str, Any] = {}
    tensors: dict[str, dict[str, Any]] = {"model": {}, "optim": {}}
    states: list[tuple[int, str, dict[str, Any], dict[str, Any]]] = []
    record: dict[str, dict[str, str]] = {}
    for folder, manifest in held:
        ranks = manifest["states"]["ranks"]
        renamed: dict[str, str] = {}
        for fname, info in manifest["files"].items():
            kind = fname.split("-", 1)[0]
            if kind in ("model", "optim") and fname.endswith(".safetensors"):
                renamed[fname] = new = data_file(kind, ranks[info["rank"]], world)
                os.link(os.path.join(folder, fname), os.path.join(target, new))
                files[new] = {**info, "rank": ranks[info["rank"]]}
        for i, ref in enumerate(manifest["states"]["files"]):
            states.append((ranks[i], folder, manifest, ref))
        for kind, index in (("model", MODEL_INDEX), ("optim", OPTIM_INDEX)):
            if index not in manifest["files"]:
                continue
            with open(os.path.join(folder, index), "rb") as fh:
                section = json.load(fh)["distrun"]["tensors"]
            for tname, info in section.items():
                entry = tensors[kind].setdefault(tname, {**info, "pieces": []})
                if not covered(entry, [0] * len(entry["shape"]), entry["shape"]):
                    entry["pieces"].extend({**p, "file": renamed[p["file"]]}
                                           for p in info["pieces"])
        for index, kept in manifest.get(TENSORS, {}).items():
            record.setdefault(index, {}).update(kept)
    if OPTIM_JSON in base["files"]:
        os.link(os.path.join(parts[0], OPTIM_JSON), os.path.join(target, OPTIM_JSON))
        files[OPTIM_JSON] = base["files"][OPTIM_JSON]
    states.sort(key=lambda s: s[0])
    listed = []
    for i, (rank, folder, manifest, ref) in enumerate(states):
        entry: dict[str, Any] = {"json": None, "tensors": None}
        for key, new in zip(("json", "tensors"), state_files(i), strict=True):
            if ref.get(key):
                os.link(os.path.join(folder, ref[key]), os.path.join(target, new))
                files[new] = {**manifest["files"][ref[key]], "rank": rank}
                entry[key] = new
        listed.append(entry)
    for kind, index in (("model", MODEL_INDEX), ("optim", OPTIM_INDEX)):
        if index in base["files"]:
            files[index] = write_json(os.path.join(target, index), _hf_index(tensors[kind]))
    ranks = [s[0] for s in states]
    whole = ranks == list(range(world))
    merged = {**base, "files": files, "world_size": len(ranks), TENSORS: record,
              "states": {"world_size": len(ranks), "files": listed,
                         **({} if whole else {"ranks": ranks})}}
    if whole:
        merged.pop(PART)
    write_json(os.path.join(target, MANIFEST), merged)

