"""Test plugin for the elastic tests: a data-parallel strategy, fault injection and records.

Loaded in the launcher and the workers with ``DISTRUN_PLUGINS=elastic_faults`` (this folder on
PYTHONPATH). Faults are read from the environment; ``attempt`` is TORCHELASTIC_RESTART_COUNT
(the tests run one node when they use it):

- ``EL_KILL_PLAN="attempt:step:rank,..."``: SIGKILL that rank at the end of that step, before
  any checkpoint of the step is written;
- ``EL_CKPT_KILL="attempt:step"``: rank 0 SIGKILLs itself while committing the checkpoint of
  that step (after its files are written, at the rename that would publish it);
- ``EL_KILL_AFTER_COMMIT="attempt:step:rank"``: that rank SIGKILLs itself once the checkpoint
  of that step is committed (``latest`` names it), before the step's boundary;
- ``EL_SLOW_ROW="attempt:step:rank"``: that rank takes a second over logging that step's row,
  before any logger writes it (a stop that comes then comes while a checkpoint's rows are
  logged);
- ``EL_STALL="attempt:step:rank"``: that rank sleeps for an hour inside the step;
- ``EL_WAIT_AT="attempt:step"``: rank 0 writes ``waiting`` before it trains that step, then
  waits until ``go`` exists;
- ``EL_SIGTERM="attempt:step:rank"``: that rank sends itself SIGTERM at the end of the step;
- ``EL_RAISE="step:rank"``: that rank raises inside the step, in every attempt;
- ``EL_COMMIT_PAUSE="step"``: the first time rank 0 of a 2-rank world commits the checkpoint of
  that step, it writes ``paused.json`` (its pid, node, round) once its files are written and
  synced (before the commit's compare-and-swap), then waits until ``go`` exists (a test
  freezes its node meanwhile);
- ``EL_RECORD_DIR``: every worker appends its start (attempt, rank, world size, step, cursor,
  checkpoint) to ``events.jsonl`` and the sample indices of each step to ``samples.jsonl``;
  rank 0 saves the final weights to ``final.pt``;
- ``EL_DIGEST=1``: the start's record also carries a digest of the model's weights (as
  resumed), and every rank appends the digest at the end of each step to ``digests.jsonl``.
"""

from __future__ import annotations

import json
import os
import signal
import time

from distrun.plugin import StrategyInfo, hookimpl


def _attempt() -> str:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def _append(name: str, record: dict) -> None:
    folder = os.environ.get("EL_RECORD_DIR")
    if folder:
        with open(os.path.join(folder, name), "a") as fh:
            fh.write(json.dumps(record) + "\n")


def _make_gradsum(config):
    import torch
    import torch.distributed as dist

    from distrun.plugin import BaseStrategy

    class GradSum(BaseStrategy):
        """Replicated model; gradients averaged over ranks with one all-reduce per tensor."""

        name = "gradsum"

        def optimizer_step(self, optimizer):
            if self.distributed:
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            dist.all_reduce(p.grad)
                            p.grad.div_(self.world_size)
            optimizer.step()

        def wrap_model(self, model):
            model = model.to(self.device)
            if self.distributed:  # every rank starts from rank 0's weights
                with torch.no_grad():
                    for t in model.state_dict().values():
                        dist.broadcast(t, src=0)
            return model

    return GradSum(config)


@hookimpl
def distrun_register_strategies(register):
    register(StrategyInfo("gradsum", _make_gradsum, help="test strategy: averaged gradients",
                          plugin="elastic_faults"))


def _pause_at_commit(run, step: int) -> None:
    """Hold the commit of ``step`` after its files are synced, until the test says go."""
    from distrun_safetensors.files import observe_durable

    folder = os.environ["EL_RECORD_DIR"]

    def hold(what: str) -> None:
        marker = os.path.join(folder, "paused.json")
        if what != "tmp folder synced" or run.progress.step != step or os.path.exists(marker):
            return
        with open(marker + ".tmp", "w") as fh:
            json.dump({"pid": os.getpid(), "node": os.environ.get("EL_NODE", ""),
                       "generation": run.generation, "step": step}, fh)
        os.replace(marker + ".tmp", marker)
        while not os.path.exists(os.path.join(folder, "go")):
            time.sleep(0.05)

    observe_durable(hold)


def _parent() -> str:
    """The module the worker's parent process runs (a launcher, or a warm spare)."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as fh:
            argv = fh.read().decode(errors="replace").split("\0")
    except OSError:
        return ""
    return argv[argv.index("-m") + 1] if "-m" in argv[:-1] else ""


@hookimpl
def distrun_on_fit_start(run):
    pause = os.environ.get("EL_COMMIT_PAUSE", "")
    if pause and run.rank == 0 and run.world_size == 2:
        _pause_at_commit(run, int(pause))
    _append("events.jsonl", {
        "pid": os.getpid(), "node": os.environ.get("EL_NODE", ""), "attempt": int(_attempt()),
        "rank": run.rank, "world": run.world_size, "step": run.progress.step,
        "epoch": run.progress.epoch, "cursor": run.sampler.cursor if run.sampler is not None else None,
        "resumed_from": run.resumed_from, "master_addr": os.environ.get("MASTER_ADDR"),
        "generation": run.generation, "parent": _parent(),
        **({"digest": _digest(run)} if os.environ.get("EL_DIGEST") else {}),
    })


def _digest(run) -> str:
    """SHA-256 of the model's weights, in state-dict order (bit-equal weights, equal digests);
    a sharded tensor (FSDP) whole (every rank calls this together)."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for name, t in run.unwrapped_model().state_dict().items():
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@hookimpl(wrapper=True)
def distrun_training_step(run, batch):
    step = run.progress.step + 1
    stall = os.environ.get("EL_STALL", "")
    if stall:
        attempt, at, rank = stall.split(":")
        if attempt == _attempt() and int(at) == step and int(rank) == run.rank:
            time.sleep(3600)
    wait_at = os.environ.get("EL_WAIT_AT", "")
    if wait_at == f"{_attempt()}:{step}" and run.rank == 0:
        folder = os.environ["EL_RECORD_DIR"]
        open(os.path.join(folder, "waiting"), "w").close()
        while not os.path.exists(os.path.join(folder, "go")):
            time.sleep(0.05)
    failure = os.environ.get("EL_RAISE", "")
    if failure and failure == f"{step}:{run.rank}":
        raise RuntimeError(f"injected failure at step {step}")
    _append("samples.jsonl", {"attempt": int(_attempt()), "rank": run.rank, "step": step,
                              "world": run.world_size, "idx": batch[2].tolist()})
    return (yield)


@hookimpl(tryfirst=True)
def distrun_on_step_end(run, step):
    if os.environ.get("EL_DIGEST"):
        _append("digests.jsonl", {"attempt": int(_attempt()), "rank": run.rank, "step": step,
                                  "node": os.environ.get("EL_NODE", ""), "digest": _digest(run)})
    for item in filter(None, os.environ.get("EL_KILL_PLAN", "").split(",")):
        attempt, at, rank = item.split(":")
        if attempt == _attempt() and int(at) == step and int(rank) == run.rank:
            os.kill(os.getpid(), signal.SIGKILL)
    term = os.environ.get("EL_SIGTERM", "")
    if term and term == f"{_attempt()}:{step}:{run.rank}":
        os.kill(os.getpid(), signal.SIGTERM)


@hookimpl(tryfirst=True)
def distrun_log_metrics(run, step, metrics):
    if os.environ.get("EL_SLOW_ROW", "") == f"{_attempt()}:{step}:{run.rank}":
        time.sleep(1.0)


@hookimpl(wrapper=True)
def distrun_save_checkpoint(run, reason):
    spec = os.environ.get("EL_CKPT_KILL", "")
    if spec and run.rank == 0:
        attempt, at = spec.split(":")
        if attempt == _attempt() and int(at) == run.progress.step:
            _die_at_commit()
    path = yield
    after = os.environ.get("EL_KILL_AFTER_COMMIT", "")
    if path and after == f"{_attempt()}:{run.progress.step}:{run.rank}":
        _die_once_committed(path)
    return path


def _die_once_committed(path: str) -> None:
    """SIGKILL this process once ``latest`` (beside ``path``) names ``path``: committed."""
    latest = os.path.join(os.path.dirname(path), "latest")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with open(latest) as fh:
                if fh.read().strip() == os.path.basename(path):
                    break
        except OSError:
            pass
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)


def _die_at_commit() -> None:
    """Make the next rename of a checkpoint's temporary folder kill this process instead."""
    for name in ("rename", "replace"):
        real = getattr(os, name)

        def patched(src, dst, *a, _real=real, **kw):
            if os.path.basename(str(src)).startswith(".tmp"):
                os.kill(os.getpid(), signal.SIGKILL)
            return _real(src, dst, *a, **kw)

        setattr(os, name, patched)


@hookimpl
def distrun_on_fit_end(run):
    folder = os.environ.get("EL_RECORD_DIR")
    if folder:  # a sharded tensor (FSDP) whole: every rank gathers it, rank 0 saves
        import torch

        state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                 for k, v in run.unwrapped_model().state_dict().items()}
        if run.is_global_zero:
            torch.save(state, os.path.join(folder, "final.pt"))
