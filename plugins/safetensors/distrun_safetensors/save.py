"""Saving: every rank writes its pieces in parallel, rank 0 commits the folder atomically.

Commit protocol (see FORMAT.md): all files go into ``<dir>/.tmp-step-N-<id>/`` and are fsynced;
each rank reports its files with sizes and CRC-32Cs to rank 0, which commits them
(:mod:`~distrun_safetensors.commit`: the indexes and the manifest, then, under the folder's
commit lock and only when no newer generation took over, the rename to ``step-N`` and the new
``latest``). Old checkpoints are pruned only after that. Rank 0 draws this start's generation
(:mod:`~distrun_safetensors.fence`) at its first save. What one rank writes is
:mod:`~distrun_safetensors.rank_files`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from distrun_safetensors import comm
from distrun_safetensors.commit import commit, tag, write_record
from distrun_safetensors.errors import FencedError
from distrun_safetensors.fence import (
    STALE_AFTER,
    draw_generation,
)
from distrun_safetensors.files import CheckpointError
from distrun_safetensors.in_place import InPlace, Snapshot
from distrun_safetensors.leftovers import LOCK_SUFFIX, claim
from distrun_safetensors.manifest import MONITOR, read_latest
from distrun_safetensors.pieces import Piece, is_dtensor, plan_pieces
from distrun_safetensors.rank_files import _write_rank_files, collect_optimizer
from distrun_safetensors.retention import (
    Retention,
    prune,
)
from distrun_safetensors.statecodec import encode

__all__ = ["Checkpointer", "Retention", "Scope"]

log = logging.getLogger("distrun")


@dataclass(frozen=True)
class Scope:
    """A save across some ranks only, into a folder of theirs (one node's, the memory tier's
    across nodes): their global ranks, a process group of them for the save's calls, another
    for its background write, and one of every rank (``across``), in which each scope says
    that it committed before any prunes its previous checkpoint: every scope then holds the
    newest step every scope committed, whichever of them a fault cut short."""

    members: tuple[int, ...]
    group: Any
    background: Any
    across: Any
    #: the world size of the save these ranks hold a part of (a state sharded across nodes:
    #: their pieces do not tile the tensors); 0 when they hold every tensor whole
    part_of: int = 0
    #: the nodes' ring that copies each node's part into the next node's memory (a
    #: :class:`~distrun_safetensors.replica.Ring`; None: no copy)
    ring: Any = None


class Checkpointer:
    """Writes checkpoints of one run into ``directory`` (every rank holds one).

    ``rdzv_generation`` is the rendezvous round this process runs in (``run.generation``);
    rank 0 draws this start's generation from the folder at the first save (see
    :mod:`~distrun_safetensors.fence`), and a commit fails with :class:`FencedError` once a
    newer start of the run took over the folder.
    """

    def __init__(self, directory: str, keep_last: int = 0, split_bytes: int = 4 << 20,
                 async_save: bool = False, rdzv_generation: int = 0,
                 lock_stale_after: float = STALE_AFTER, in_place: bool = False,
                 scope: Scope | None = None) -> None:
        if in_place and (not async_save or keep_last != 1):
            raise ValueError("in-place saves are async and keep the last checkpoint only")
        self.directory = directory
        self.rdzv_generation = rdzv_generation
        self.lock_stale_after = lock_stale_after
        #: this start's generation (rank 0, from its first save on)
        self.generation: int | None = None
        self.keep_last = keep_last
        self.split_bytes = split_bytes
        self.async_save = async_save
        self._thread: threading.Thread | None = None  # an async save's write and commit
        self._pruner: threading.Thread | None = None  # rank 0: removing old checkpoints
        self._error: BaseException | None = None
        self._staging: dict[str, torch.Tensor] = {}  # async: CPU copies, reused between saves
        #: async, ``in_place``: the snapshot goes straight into the files (see in_place.py)
        self.in_place = in_place
        self._in_place: InPlace | None = None
        #: the last save: ``{"step", "stall_s", "waited_s", "write_s"}``: the time the caller was
        #: held (of which ``waited_s`` waiting for the previous async write) and the time to
        #: write and commit (None while an async write is in flight). ``on_written(stats)`` is
        #: called (in the writing thread) once an async save is committed.
        self.stats: dict[str, Any] = {}
        self.on_written: Any = None
        self._group: Any = None
        self.last: tuple[int, str] | None = None
        self.pending: tuple[int, str] | None = None
        self._claims: dict[str, int] = {}  # rank 0: lock of each temporary folder it writes
        #: ``room_check(nbytes)``: this rank's tensor bytes of a save -> a refusal (one line)
        #: or None, asked before anything is written (the memory tier's room)
        self.room_check: Any = None
        #: the ranks this checkpointer saves across, None for all (see :class:`Scope`)
        self.scope = scope
        #: in-place saves after the first: their folders' names (see :meth:`_quiet_start`)
        self._token: str | None = None
        self._count = 0

    # -- public ---------------------------------------------------------------------------
    def save(self, step: int, model: torch.nn.Module, optimizer: Any = None,
             state: Mapping[str, Any] | None = None, reason: str = "user",
             info: Mapping[str, Any] | None = None, *, record: Mapping[str, Any] | None = None,
             retention: Retention | None = None,
             owners: tuple[frozenset[str], frozenset[str]] | None = None,
             snapshot: Snapshot | None = None) -> str:
        """Write a checkpoint of ``step``; every rank calls this together. Returns its path.

        With ``async_save`` the tensors are copied to CPU memory here and written by a
        background thread; the returned path exists once :meth:`wait` returns.

        ``record`` (the monitored metric, ``{"name", "mode", "value", "step"}``) goes into the
        manifest under ``monitor``; when this checkpointer already committed ``step``, it is
        added to that folder's manifest instead of writing the tensors again. ``retention``
        (rank 0) updates the ``best`` pointer and keeps the top k when pruning. ``owners``
        (rank 0): the folders checkpoint callbacks keep, and those their writers let go
        (see :func:`~distrun_safetensors.callback.owners`), for the pruning after the commit.

        ``snapshot``: this step's tensors as another checkpointer's in-place save holds them
        (:meth:`snapshot`, the memory tier's): the save writes from them in the background,
        async or not, instead of copying the state, and releases them when it is written.
        """
        started = time.perf_counter()
        self.wait()  # the previous async write: its buffers are about to be reused
        waited = time.perf_counter() - started
        final = os.path.join(self.directory, f"step-{step}")
        if self.last is not None and self.last[0] == step and os.path.isdir(self.last[1]):
            if snapshot is not None:
                snapshot.release()
            if record is not None:
                self._tag(self.last[1], dict(record), retention, owners)
                seconds = time.perf_counter() - started
                self.stats = {"step": step, "stall_s": seconds, "waited_s": waited,
                              "write_s": seconds, "tagged": True}
            else:  # nothing to write: that step's checkpoint is this one
                self.stats = {"step": step, "stall_s": 0.0, "waited_s": waited,
                              "write_s": 0.0, "reused": True}
            return self.last[1]
        if record is not None:
            info = {**dict(info or {}), MONITOR: dict(record)}
        rank, world = self._rank_world()
        group = self.scope.group if self.scope is not None else None
        if self._token is not None and snapshot is None:  # an in-place save after the first
            job, tmp = self._quiet_start(rank, world, model, optimizer, state, step, reason,
                                         info)
        else:
            job, tmp = self._agreed_start(rank, world, group, model, optimizer, state, step,
                                          reason, info, snapshot)
        job.update(retention=retention, owners=owners)
        if rank == 0 and self.generation is None:  # before this save's gather: see fence.py
            try:
                self.generation = draw_generation(self.directory, self.rdzv_generation,
                                                  self.lock_stale_after)
            except (OSError, CheckpointError) as exc:  # said by the commit, to every rank
                job["error"] = f"cannot draw a generation in {self.directory} ({_said(exc)})"
                job["full"] = _is_full(exc)
        if not self.async_save and "release" not in job:
            self._write_and_commit(job, tmp, final, None)
            seconds = time.perf_counter() - started
            self.stats = {"step": step, "stall_s": seconds, "waited_s": waited,
                          "write_s": seconds}
            return final
        if not self.in_place and "release" not in job:
            job["pieces"] = self._stage(job["pieces"])
        if self.scope is not None:
            self._group = self.scope.background
        elif self._group is None and comm.active():
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo")
        self.pending = (step, final)
        self.stats = {"step": step, "stall_s": time.perf_counter() - started,
                      "waited_s": waited, "write_s": None, "from_snapshot": "release" in job}
        self._thread = threading.Thread(target=self._background, name="distrun-ckpt-save",
                                        args=(job, tmp, final), daemon=True)
        self._thread.start()
        return final

    def _agreed_start(self, rank: int, world: int, group: Any, model: torch.nn.Module,
                      optimizer: Any, state: Mapping[str, Any] | None, step: int, reason: str,
                      info: Mapping[str, Any] | None,
                      snapshot: Snapshot | None) -> tuple[dict[str, Any], str]:
        """The start of a save: rank 0 makes its folder and names it to the others, then every
        rank collects (an in-place save also stages) its pieces, and they agree that none
        failed before anything is written (the error is raised on every rank if one did)."""
        tmp: Any = None
        if rank == 0:
            try:
                os.makedirs(self.directory, exist_ok=True)
                tmp = os.path.join(self.directory, f".tmp-step-{step}-{uuid.uuid4().hex[:8]}")
                self._claims[tmp] = claim(tmp)
                os.mkdir(tmp)
            except OSError as exc:
                if tmp is not None:
                    self._release(tmp)  # its lock file too: nothing of this save is left
                tmp = {"error": f"cannot create a folder in {self.directory} ({_said(exc)})",
                       "full": _is_full(exc)}
        tmp = comm.broadcast(tmp, group)
        if isinstance(tmp, dict) and snapshot is not None:
            snapshot.release()
        if isinstance(tmp, dict):
            hint = self._room_hint() if tmp.get("full") else ""
            raise CheckpointError(f"checkpoint step {step} was not saved: {tmp['error']}{hint}")
        job: dict[str, Any] = {}
        error = views = None
        try:
            job = self._collect(rank, world, model, optimizer, state, step, reason, info)
            error = self._room(job)
            if error is None and self.in_place:  # the snapshot, into this save's files
                job["mapped"] = self._stage_in_place(job, tmp)
            if snapshot is not None:
                views = _from_snapshot(job["pieces"], snapshot)
        except Exception as exc:
            error = f"rank {rank}: {exc}"
        error = comm.agree(error, group)  # every rank fails together, before any file is written
        if snapshot is not None:  # written from it on every rank, or on none
            if not error and comm.agree(None if views is not None else "stage", group) is None:
                job["pieces"], job["release"] = views, snapshot.release
            else:
                snapshot.release()
        if error:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                self._release(tmp)
            raise CheckpointError(f"checkpoint step {step} was not saved: {error}")
        if self.in_place:  # the next saves name their folders from it (see _quiet_start)
            self._token = os.path.basename(tmp).rpartition("-")[2]
        return job, tmp

    def _quiet_start(self, rank: int, world: int, model: torch.nn.Module, optimizer: Any,
                     state: Mapping[str, Any] | None, step: int, reason: str,
                     info: Mapping[str, Any] | None) -> tuple[dict[str, Any], str]:
        """The start of an in-place save after the first, with no call between the ranks (a
        save every step: each call would stall every step): its folder's name is derived
        from the first save's and a count, and each rank makes it; a rank's error goes to the
        commit's gather (the save then fails on every rank together, at :meth:`wait`, and
        nothing of it is kept). A rank may make the folder before rank 0 claims it, so the
        pruning of in-place saves never sweeps leftovers (it would take the folder for a dead
        save's): their folder is the memory tier's, swept at the run's start only."""
        self._count += 1
        tmp = os.path.join(self.directory, f".tmp-step-{step}-{self._token}-{self._count}")
        job: dict[str, Any] = {"rank": rank, "world": world, "step": step}
        try:
            if rank == 0:
                self._claims[tmp] = claim(tmp)
            os.makedirs(tmp, exist_ok=True)
            job = self._collect(rank, world, model, optimizer, state, step, reason, info)
            error = self._room(job)
            if error is not None:
                raise CheckpointError(error)
            job["mapped"] = self._stage_in_place(job, tmp)
        except Exception as exc:
            job["early"] = _said(exc)
        return job, tmp

    def _room(self, job: dict[str, Any]) -> str | None:
        """The room check's refusal of this rank's share of the save, or None."""
        if self.room_check is None:
            return None
        nbytes = sum(p.nbytes for _, p in job["pieces"]) + sum(
            t.numel() * t.element_size() for t in job["state_tensors"].values())
        refusal: str | None = self.room_check(nbytes)
        return refusal

    def _stage_in_place(self, job: dict[str, Any], tmp: str) -> dict[str, Any]:
        """This rank's pieces copied into its files in ``tmp`` (an in-place save)."""
        if self._in_place is None:
            self._in_place = InPlace(self.directory, job["rank"])
        return self._in_place.stage(job, tmp, self.last[0] if self.last else None)

    def snapshot(self, step: int) -> Snapshot | None:
        """This rank's tensors of the in-place save of ``step`` (the last one), for another
        checkpointer to write from (``save(snapshot=...)``); None when there is none."""
        return self._in_place.snapshot(step) if self._in_place is not None else None

    def committed(self, step: int) -> str | None:
        """The folder of ``step`` if this checkpointer committed it (a save of ``step`` would
        then not write again); waits for an async save in flight."""
        self.wait()
        if self.last is not None and self.last[0] == step and os.path.isdir(self.last[1]):
            return self.last[1]
        return None

    def wait(self) -> None:
        """Wait for an async save in flight and for the pruning of old checkpoints; re-raise
        the async save's error on this rank."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            self.pending = None
        if self._pruner is not None:
            self._pruner.join()
            self._pruner = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    # -- steps ----------------------------------------------------------------------------
    def _rank_world(self) -> tuple[int, int]:
        """This rank's place in the save, and how many ranks save together."""
        rank, world = comm.rank_world()
        if self.scope is None:
            return rank, world
        return self.scope.members.index(rank), len(self.scope.members)

    def _collect(self, rank: int, world: int, model: torch.nn.Module, optimizer: Any,
                 state: Mapping[str, Any] | None, step: int, reason: str,
                 info: Mapping[str, Any] | None) -> dict[str, Any]:
        model_sd = model.state_dict()
        for name, value in model_sd.items():
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(f"model state {name!r} is a {type(value).__name__}, not a "
                                      "tensor; distrun-safetensors stores tensors only")
        members = self.scope.members if self.scope is not None else None
        pieces = [("model", p) for p in plan_pieces(model_sd.items(), rank, world,
                                                    self.split_bytes, members)]
        optim_meta = None
        if optimizer is not None:
            named, optim_meta = collect_optimizer(optimizer, model)
            pieces += [("optim", p) for p in plan_pieces(named, rank, world, self.split_bytes,
                                                         members)]
        state_tensors: dict[str, torch.Tensor] = {}
        state_json = encode(dict(state or {}), "state", state_tensors)
        layouts = sorted({str(tuple(v.device_mesh.shape)) + " " + str(v.device_mesh.mesh_dim_names)
                          for v in model_sd.values() if is_dtensor(v)})
        return {"rank": rank, "world": world, "members": members, "step": step,
                "part_of": self.scope.part_of if self.scope is not None else 0,
                "reason": reason,
                "pieces": pieces, "optim_meta": optim_meta, "state_json": state_json,
                "state_tensors": state_tensors, "meshes": layouts, "info": dict(info or {}),
                "order": list(model_sd)}

    def _stage(self, pieces: list[tuple[str, Piece]]) -> list[tuple[str, Piece]]:
        """Copy each piece into its CPU buffer (allocated on the first save, then reused:
        :meth:`save` waits for the previous write before it overwrites them)."""
        staged, used = [], set()
        on_gpu = False
        for kind, piece in pieces:
            src = piece.tensor.detach()
            cuda = src.device.type == "cuda"  # pinned buffers let the copy run asynchronously
            on_gpu = on_gpu or cuda
            name = f"{kind}/{piece.key}"
            buf = self._staging.get(name)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=cuda)
                self._staging[name] = buf
            buf.copy_(src, non_blocking=cuda)
            used.add(name)
            staged.append((kind, Piece(piece.name, piece.key, piece.dtype, piece.global_shape,
                                       piece.offsets, buf, piece.layout)))
        if on_gpu:
            torch.cuda.synchronize()  # the copies are complete before training moves on
        for name in set(self._staging) - used:  # a tensor the model no longer has
            del self._staging[name]
        return staged

    def _background(self, job: dict[str, Any], tmp: str, final: str) -> None:
        started = time.perf_counter()
        try:
            self._write_and_commit(job, tmp, final, self._group)
        except BaseException as exc:  # re-raised on the main thread by wait()
            self._error = exc
            return
        finally:
            if "release" in job:  # the snapshot written from is free to be written over
                job["release"]()
        self.stats["write_s"] = time.perf_counter() - started
        if self.on_written is not None:
            self.on_written(dict(self.stats, path=final))

    def _write_and_commit(self, job: dict[str, Any], tmp: str, final: str, group: Any) -> None:
        error = None
        report: dict[str, Any] = {}
        full = False
        try:
            if job.get("early"):  # this rank could not start the save (see _quiet_start)
                raise CheckpointError(job["early"])
            report = _write_rank_files(job, tmp)
        except Exception as exc:
            error, full = f"rank {job['rank']}: {_said(exc)}", _is_full(exc)
        reports = comm.gather({"error": error, "full": full, **report}, group)
        outcome = None
        if job["rank"] == 0:
            try:
                outcome = self._commit(job, reports or [], tmp, final)
            except FencedError as exc:
                outcome = {"error": str(exc), "fenced": True}
                shutil.rmtree(tmp, ignore_errors=True)
            except Exception as exc:
                outcome = {"error": _said(exc)}
                shutil.rmtree(tmp, ignore_errors=True)
                if _is_full(exc) or job.get("full") or any(r.get("full") for r in reports or []):
                    outcome["error"] += self._room_hint()
            finally:
                self._release(tmp)
            if not outcome.get("error") and self.scope is None:
                # only once the claim is released: a pruner started earlier lists the claim's
                # lock file, judges it abandoned when the release lands in between and
                # re-creates it to remove it, touching the folder after save() returned
                self._start_pruning(final, job.get("retention"), job.get("owners"))
            if outcome.get("fenced"):
                # the ranks of a stale round are often gone: say why, whatever they hear
                with contextlib.suppress(Exception):
                    comm.broadcast(outcome, group)
                    self._across(job, outcome)
                raise FencedError(outcome["error"])
        outcome = comm.broadcast(outcome, group)
        if outcome.get("fenced"):
            raise FencedError(outcome["error"])
        if self.scope is not None:
            outcome = self._across(job, outcome)
        if outcome.get("error"):
            raise CheckpointError(f"checkpoint step {job['step']} was not saved: "
                                  f"{outcome['error']}")
        self.last = (job["step"], final)
        if self._in_place is not None:
            self._in_place.keep(job["step"], final, job.get("mapped", {}))

    def _across(self, job: dict[str, Any], outcome: dict[str, Any]) -> dict[str, Any]:
        """A scope's save: whether every scope committed (each rank says its scope's outcome),
        and only then its leader prunes the previous checkpoint (see :class:`Scope`)."""
        if self.scope is None:
            return outcome
        failed = comm.agree(outcome.get("error") and f"rank {comm.rank_world()[0]}'s group: "
                            f"{outcome['error']}", self.scope.across)
        if failed:
            return {"error": outcome.get("error") or failed}
        if self.scope.ring is not None:  # every node's part into the next node's memory
            error = None
            if job["rank"] == 0:
                from distrun_safetensors.replica import exchange

                try:
                    exchange(self.scope.ring, os.path.join(self.directory,
                                                           f"step-{job['step']}"), job["step"])
                except Exception as exc:
                    error = f"rank {comm.rank_world()[0]}'s copy of its node's part to the " \
                            f"next node failed ({_said(exc)})"
            failed = comm.agree(error, self.scope.across)
            if failed:
                return {"error": failed}
        if job["rank"] == 0:
            final = os.path.join(self.directory, f"step-{job['step']}")
            self._start_pruning(final, job.get("retention"), job.get("owners"))
        return outcome

    def _commit(self, job: dict[str, Any], reports: list[dict[str, Any]], tmp: str,
                final: str) -> dict[str, Any]:
        errors = [job["error"]] if job.get("error") else []
        errors += [r["error"] for r in reports if r.get("error")]
        if errors:
            raise RuntimeError("; ".join(errors))
        write_record(job, reports, tmp, self.generation or 0, self.rdzv_generation)
        retention = job.get("retention")
        commit(self.directory, job["step"], tmp, final, self.generation or 0, retention,
               self.lock_stale_after)
        return {"error": None}

    def _tag(self, folder: str, record: dict[str, Any], retention: Retention | None,
             owners: tuple[frozenset[str], frozenset[str]] | None = None) -> None:
        """Record the monitored value in the committed ``folder`` (rank 0), then move ``best``
        and prune as after a commit."""
        if comm.rank_world()[0] != 0:
            return
        try:
            tag(self.directory, folder, record, retention, self.generation or 0,
                self.lock_stale_after)
        except (OSError, ValueError, CheckpointError, FencedError) as exc:
            log.warning("checkpoint: could not record %s=%s in %s (%s); it is not counted as "
                        "one of the best", record.get("name"), record.get("value"), folder, exc)
            return
        self._start_pruning(folder, retention, owners)

    def _start_pruning(self, keep: str, retention: Retention | None,
                       owners: tuple[frozenset[str], frozenset[str]] | None = None) -> None:
        # removing old checkpoints is housekeeping: it overlaps training (wait() joins it)
        held, released = owners or (frozenset(), frozenset())
        self._pruner = threading.Thread(target=prune, daemon=True, name="distrun-ckpt-prune",
                                        args=(self.directory, keep, self.keep_last, retention,
                                              held, released, self.lock_stale_after,
                                              not self.in_place))
        self._pruner.start()

    def _room_hint(self) -> str:
        """What to do about a full disk, and that the last checkpoint is untouched."""
        latest, _ = read_latest(self.directory)
        kept = (f" (latest still names {os.path.basename(latest)}, which is intact)"
                if latest is not None and os.path.isdir(latest) else "")
        return (f"; free space in {self.directory} or give --ckpt-dir a folder with room for "
                f"the checkpoints{kept}")

    def _release(self, tmp: str) -> None:
        fd = self._claims.pop(tmp, None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp + LOCK_SUFFIX)
            os.close(fd)


def _from_snapshot(pieces: list[tuple[str, Piece]], snapshot: Snapshot) -> list[
        tuple[str, Piece]] | None:
    """``pieces`` with their tensors taken from ``snapshot``; None unless every one is there
    with its dtype and shape (another layout: the save copies the live tensors)."""
    out = []
    for kind, p in pieces:
        held = snapshot.tensors.get((kind, p.key))
        if held is None or held.dtype != p.tensor.dtype or held.shape != p.tensor.shape:
            return None
        out.append((kind, Piece(p.name, p.key, p.dtype, p.global_shape, p.offsets, held,
                                p.layout)))
    return out


#: a write that failed for want of room: the user's to fix (free space, another --ckpt-dir)
_FULL = (errno.ENOSPC, errno.EDQUOT)


def _is_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in _FULL


def _said(exc: BaseException) -> str:
    """An error of a save in words: a system error as its reason and the file it concerns."""
    if isinstance(exc, OSError) and exc.strerror:
        where = f" ({exc.filename})" if exc.filename else ""
        what = "the disk is full" if exc.errno in _FULL else "a system call failed"
        return f"{what}: {exc.strerror}{where}"
    return str(exc)
