"""Entry point of distrun-safetensors (torch-free at import): options, hooks, ``distrun ckpt``."""

from __future__ import annotations

import os
import time
from typing import Any

from distrun.plugin import StashKey, hookimpl
from distrun_safetensors.options import CheckpointOptions
from distrun_safetensors.session import _KEY, _checkpointer, _opts, ckpt_dir, run_key

DISTRUN_PLUGIN_API = 1  # the distrun.plugin API this plugin is written for

PLUGIN = "safetensors"
_LAST_SAVE: StashKey[float] = StashKey("safetensors.last_save")  # monotonic seconds
_BEST: StashKey[Any] = StashKey("safetensors.best")  # best.Best, with --ckpt-monitor
#: the nodes' view of the checkpoint folder, once checked: "" shared (or one node), else the
#: one line a save or a resume fails with
_UNSHARED: StashKey[str] = StashKey("safetensors.unshared")
#: whether the checkpoint folder holds another run's checkpoints this run does not continue:
#: "" no, else the one line a save fails with
_FOREIGN: StashKey[str] = StashKey("safetensors.foreign")
#: the memory tier's folder distrun_checkpoint_found looked in, for the load right after it
_RESUME_TIER: StashKey[Any] = StashKey("safetensors.resume_tier")


@hookimpl
def distrun_register_options(register):
    register(CheckpointOptions)


@hookimpl
def distrun_node_services(config):
    """The memory tier's folder, held by the launcher (``--ckpt-memory-every-n-steps``)."""
    if CheckpointOptions.of(config).ckpt_memory_every_n_steps and not config.get("ft"):
        from distrun_safetensors.memory_tier import MemoryTier

        return MemoryTier()
    return None


@hookimpl
def distrun_resume_words():
    return {"best": "the best checkpoint --ckpt-monitor kept"}


def _check_storage(run: Any) -> None:
    """Multi-node runs: refuse per-host checkpoint folders (see :mod:`.storage`), once per run.

    An elastic run is refused at its start; a static one when it is set to save or resume,
    otherwise at its first save (a preemption's included).
    """
    unshared = run.stash.get(_UNSHARED)
    if unshared is None:
        from distrun_safetensors.storage import node_count, probe

        found = probe(ckpt_dir(run)) if node_count() > 1 else None
        unshared = "" if found is None else _unshared_line(run, found.describe())
        run.stash[_UNSHARED] = unshared
        cfg = _opts(run)
        wants = (cfg.ckpt_every_n_steps or cfg.ckpt_every_n_seconds or cfg.ckpt_monitor
                 or (cfg.ckpt_save_on_end and not _end_save_by_default(run))
                 or run.config.resume != "never")
        if unshared and (run.generation > 0 or wants):
            from distrun.plugin import UsageError

            raise UsageError(unshared)
    elif unshared:
        from distrun.plugin import UsageError

        raise UsageError(unshared)


def _check_owner(run: Any) -> None:
    """Refuse to write into a folder holding another run's checkpoints unless this run
    continues them (resumed from one of them); once per run, rank 0 reads the manifests.

    Refused at the start when the run is set to save (the end save by default included: it
    would replace ``latest`` and prune theirs), otherwise at its first save.
    """
    line = run.stash.get(_FOREIGN)
    if line is None:
        from distrun_safetensors import comm

        line = comm.broadcast(_foreign_line(run) if run.is_global_zero else None) or ""
        run.stash[_FOREIGN] = line
        cfg = _opts(run)
        wants = not run.config.fast_dev_run and bool(
            cfg.ckpt_every_n_steps or cfg.ckpt_every_n_seconds or cfg.ckpt_monitor
            or cfg.ckpt_save_on_end)
        if line and wants:
            from distrun.plugin import UsageError

            raise UsageError(line)
    elif line:
        from distrun.plugin import UsageError

        raise UsageError(line)


def _foreign_line(run: Any) -> str | None:
    """The line refusing this run the checkpoint folder, or None when it may write there."""
    directory = ckpt_dir(run)
    if run.resumed_from:
        if os.path.realpath(os.path.dirname(os.path.abspath(run.resumed_from))) \
                == os.path.realpath(directory):
            return None  # it continues them: they are this run's now
        why = f"this run resumed from {run.resumed_from}, which is not in it"
    elif run.config.resume != "never":
        return None  # resume auto found nothing to continue: no committed checkpoint there
    else:
        why = "this run starts fresh (no --resume)"
    from distrun_safetensors.retention import other_runs

    found = other_runs(directory, run_key())
    if not found:
        return None
    names = ", ".join(os.path.basename(f) for f in found[:3])
    if len(found) > 3:
        names += f" and {len(found) - 3} more"
    return (f"the checkpoint folder {directory} holds checkpoints of another run ({names}) and "
            f"{why}: its saves would replace their latest and prune them; run with --resume "
            f"auto to continue that run, give this run another --ckpt-dir, or remove "
            f"{directory}")


def _end_save_by_default(run: Any) -> bool:
    """The save at the end is on only because it is the default (no flag, key or variable
    asked for it)."""
    return "ckpt_save_on_end" not in run.config.sources


def _unshared_line(run: Any, why: str) -> str:
    if run.generation > 0:  # under the elastic agent: the survivors resume from it
        need = ("an elastic run on several nodes resumes on the hosts that remain, from "
                "checkpoints every node wrote")
    else:
        need = "each checkpoint of a run on several nodes is written by all of them"
    return (f"the checkpoint folder {ckpt_dir(run)} is not shared by the nodes: {why}; {need}, "
            "so it needs one folder every node sees (a shared filesystem such as NFS: "
            "--ckpt-dir /shared/path)")


@hookimpl
def distrun_save_checkpoint(run, reason):
    if run.model is None:  # a rank that serves others (RPC parameter server) holds no model
        return None
    _check_storage(run)
    _check_owner(run)
    saver = _checkpointer(run)
    if reason == "preempt":
        saver.async_save = False  # the process exits right after: write it now
    from distrun_safetensors.manifest import RUN

    info = {"strategy": getattr(run.strategy, "name", None),
            "progress": run.progress.state_dict(), RUN: run_key()}
    if run.is_global_zero and saver.on_written is None:
        saver.on_written = lambda stats: run.log.info(
            "Checkpoint %s written in the background in %.2f s", stats["path"],
            stats["write_s"])
    from distrun_safetensors.callback import owners

    held_released = owners(run, saver, reason)
    record = retention = None
    best = run.stash.get(_BEST)
    if best is not None:
        record, retention = best.before_save(saver, run.progress.step, reason)
    # with the memory tier, the cadence's disk copy is written from the tier's, taken at the
    # same point of the step (in the background): the state is not copied again. Other saves
    # (the end's, a best one, the user's, a preemption's) write the state as it is now.
    snapshot = None
    if reason == "step" and _opts(run).ckpt_memory_every_n_steps:
        from distrun_safetensors.memory_tier import memory_snapshot

        snapshot = memory_snapshot(run)
    path = saver.save(run.progress.step, run.unwrapped_model(), run.optimizer,
                      run.state_dict(), reason=reason, info=info, record=record,
                      retention=retention, owners=held_released, snapshot=snapshot)
    run.stash[_LAST_SAVE] = time.monotonic()
    if run.is_global_zero:
        stats = saver.stats
        if stats.get("reused"):
            pass  # already saved at this step (by another checkpoint callback, the cadence)
        elif stats.get("tagged"):
            run.log.info("Checkpoint %s (%s): already saved at this step; its manifest now "
                         "records %s=%.6g", path, reason, record["name"], record["value"])
        elif stats.get("from_snapshot"):
            run.log.info("Checkpoint %s (%s): written from the memory tier's copy in the "
                         "background", path, reason)
        elif stats.get("write_s") is None:  # async: training goes on while it is written
            waited = (f", of which {stats['waited_s'] * 1e3:.0f} ms waiting for the previous "
                      "write") if stats["waited_s"] >= 0.001 else ""
            run.log.info("Checkpoint %s (%s): training paused %.0f ms to copy the state%s",
                         path, reason, stats["stall_s"] * 1e3, waited)
        else:
            run.log.info("Checkpoint %s (%s) in %.2f s", path, reason, stats["write_s"])
    return path


def _resume_from(run: Any) -> tuple[str, Any]:
    """The pointer a resume follows and the memory tier's folder that competes with the
    checkpoint folder (None: none), the tier's found once for both hooks below (every rank
    calls this together)."""
    from distrun_safetensors.memory_tier import tier_dir
    from distrun_safetensors.tier_nodes import node_tier

    pointer = "best" if _opts(run).ckpt_resume_best else "latest"
    tier = run.stash.pop(_RESUME_TIER, None)
    if tier is None:
        # the memory tier's checkpoints compete with the disk's: the newest committed step wins
        tier = node_tier(run, tier_dir()) \
            if pointer == "latest" and _opts(run).ckpt_memory_every_n_steps else None
    return pointer, tier


@hookimpl
def distrun_checkpoint_found(run, source):
    from distrun_safetensors.load import checkpoint_found

    if run.stage == "fit":
        _check_storage(run)
    pointer, tier = _resume_from(run)
    run.stash[_RESUME_TIER] = tier
    return checkpoint_found(source, ckpt_dir(run), pointer, tier)


@hookimpl
def distrun_load_checkpoint(run, source):
    from distrun_safetensors.load import load
    from distrun_safetensors.memory_tier import note_resume, tier_dir, wait_for_memory_save

    saver = run.stash.get(_KEY)
    if saver is not None:
        saver.wait()
    wait_for_memory_save(run)
    if run.stage == "fit":
        _check_storage(run)
    pointer, tier = _resume_from(run)
    result = load(source, run.unwrapped_model(), run.optimizer, ckpt_dir=ckpt_dir(run),
                  verify=_opts(run).ckpt_verify, pointer=pointer, tier=tier)
    if result is None:
        return None
    note_resume(run, result.step, result.path, tier_dir() if tier is not None else None)
    run.load_state_dict(result.state)
    if os.path.dirname(os.path.abspath(result.path)) == os.path.abspath(ckpt_dir(run)) \
            and run.progress.step == result.step:
        # this run's checkpoint of this very step: a save before the next step (the end of a
        # fit that had nothing left, a checkpoint callback) names it instead of rewriting it
        _checkpointer(run).last = (result.step, result.path)
    return result.path


@hookimpl(tryfirst=True)  # the initial weights are in place before other plugins look
def distrun_on_fit_start(run):
    run.stash[_LAST_SAVE] = time.monotonic()
    _check_storage(run)
    _check_owner(run)  # before anything in the folder is touched (the sweep below)
    if _opts(run).init_weights and run.model is not None:
        _init_weights(run)
    if run.is_global_zero:  # the run's owner: leftovers of a save killed in an earlier start
        from distrun_safetensors.leftovers import TRASH_PREFIX, sweep_stale

        for path in sweep_stale(ckpt_dir(run), timeout=run.config.timeout):
            what = ("a pruned checkpoint whose removal was cut short"
                    if os.path.basename(path).startswith(TRASH_PREFIX)
                    else "left by a save that did not finish")
            run.log.info("Removed %s, %s", path, what)
    opts = _opts(run)
    if run.config.fast_dev_run:
        return  # a smoke test saves nothing
    every, seconds = opts.ckpt_every_n_steps, opts.ckpt_every_n_seconds
    if every or seconds:  # a run without a save cadence has no per-step hook of ours
        run.add_hooks(Cadence(every, seconds))
    if opts.ckpt_monitor and run.model is not None:
        run.add_hooks(_best(run))
    if opts.ckpt_memory_every_n_steps and run.model is not None:
        from distrun_safetensors.memory_tier import start_tier

        start_tier(run, opts.ckpt_memory_every_n_steps, opts.ckpt_memory_max_gb,
                   opts.ckpt_memory_replica_mb_s)


def _best(run: Any) -> Any:
    """The best-k hooks, with the top k read back from the manifests on disk (rank 0 reads,
    every rank gets the same list)."""
    from distrun_safetensors import comm
    from distrun_safetensors.best import Best, scan

    cfg = _opts(run)
    entries = scan(ckpt_dir(run), cfg.ckpt_monitor, cfg.ckpt_mode) if run.is_global_zero \
        else None
    entries = comm.broadcast(entries)
    best = Best(cfg.ckpt_monitor, cfg.ckpt_mode, cfg.ckpt_save_top_k, entries)
    if run.is_global_zero and best.top.entries:
        run.log.info("Best checkpoints by %s (%s) so far: %s", cfg.ckpt_monitor, cfg.ckpt_mode,
                     ", ".join(f"{e.folder} ({e.value:.6g})" for e in best.top.entries))
    run.stash[_BEST] = best
    return best


def _init_weights(run: Any) -> None:
    path = _opts(run).init_weights
    if run.resumed_from:
        if run.is_global_zero:
            run.log.info("--init-weights %s is not loaded: the run resumed from %s (the "
                         "checkpoint wins)", path, run.resumed_from)
        return
    from distrun_safetensors.weights import load_weights

    result = load_weights(path, run.unwrapped_model(),
                          prefix=_opts(run).init_weights_prefix,
                          strict=_opts(run).init_weights_strict)
    if run.is_global_zero:
        for line in result.report():
            run.log.info("%s", line)


class Cadence:
    """Saves every ``every`` steps and/or when ``seconds`` passed since the last save."""

    def __init__(self, every: int, seconds: float) -> None:
        self.every, self.seconds = every, seconds

    @hookimpl(trylast=True)  # after the step's other hooks: their state is saved as it ends
    def distrun_on_step_end(self, run, step):
        due = bool(self.every) and step % self.every == 0
        if self.seconds and not due:
            due = _time_due(run, self.seconds)
        if due:
            run.save_checkpoint("step")


def _time_due(run: Any, seconds: float) -> bool:
    """Rank 0's clock decides for everyone (one tiny broadcast per step when enabled)."""
    elapsed = time.monotonic() - run.stash.get(_LAST_SAVE, time.monotonic())
    flag = elapsed >= seconds
    if run.world_size > 1:
        import torch
        import torch.distributed as dist

        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=run.device)
        dist.broadcast(t, src=0)
        flag = bool(t.item())
    return flag


@hookimpl
def distrun_on_fit_end(run):
    if _opts(run).ckpt_save_on_end and not run.config.fast_dev_run:
        if run.progress.step == 0 and _end_save_by_default(run):
            pass  # nothing trained (a finder's fit, max_steps 0): no checkpoint of nothing
        elif run.stash.get(_UNSHARED) and _end_save_by_default(run):
            if run.is_global_zero:  # only the default asked for it: not worth failing over
                run.log.warning("warning: no checkpoint of the last step: %s",
                                run.stash[_UNSHARED])
        else:
            run.save_checkpoint("end")
    saver = run.stash.get(_KEY)
    if saver is not None:
        saver.wait()


@hookimpl
def distrun_teardown(run):
    from distrun_safetensors.memory_tier import wait_for_memory_save

    wait_for_memory_save(run)
    saver = run.stash.get(_KEY)
    if saver is not None:
        try:
            saver.wait()
        except Exception as exc:  # teardown must not raise
            run.log.error("checkpoint: the last async save failed: %s", exc)


@hookimpl
def distrun_add_commands(cli):
    from distrun_safetensors.cli import ckpt

    cli.add_command(ckpt)
