"""How a replica group meets the others under ``--ft``: torchft's Manager (its healing state,
its servers on the run's address), the launcher's meeting folder and its marks, the resume of
a group left alone, a stop agreed inside the group, and a quorum of another torchft refused.

The loop that uses them is :mod:`distrun_ft.loop`.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from distrun.plugin import LOOPBACK, DistrunError, UsageError
from distrun_ft.launcher import ADDRESS_ENV, BARRIER_ENV, LIGHTHOUSE_ENV
from distrun_ft.options import FtOptions
from distrun_ft.settings import TORCHFT_PIN, timeouts


def _agreed(flag: bool) -> bool:
    """``flag`` of any rank of this group, on every rank of it (one tiny all-reduce)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    value = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _stop_agreed(run: Any) -> bool:
    """True once any rank of this group got a stop signal (then every rank stops as if it had
    it: the preemption checkpoint and the requeue exit are collective in the group)."""
    if not _agreed(run.stop_signal is not None):
        return False
    if run.stop_signal is None:
        run.stop_signal = int(signal.SIGTERM)
    run.done = True
    return True


def _serve_group_store() -> Any:
    """The group's store on the launcher's socket, for a one-rank group whose strategy made
    its process group over an in-memory store (fsdp, a single process): torchft's Manager
    connects to the group's store there, and nobody else serves it (on a port served already
    torch reuses that server). None on a rank other than 0."""
    from torch.distributed import rendezvous

    if os.environ.get("RANK", "0") != "0" or not os.environ.get("MASTER_PORT"):
        return None
    store, _, _ = next(rendezvous("env://", rank=0, world_size=1))
    return store


def _make_manager(run: Any, replica: int, extra: Any = None) -> Any:
    from torchft import Manager
    from torchft.checkpointing.pg_transport import PGTransport

    from distrun_ft.binding import manager_server_on, process_group_on

    t = timeouts(run.config)
    model, optimizer = run.unwrapped_model(), run.optimizer

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "progress": run.progress.state_dict(),
                "extra": extra.state_dict() if extra is not None else {}}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        run.progress.load_state_dict(state["progress"])
        if extra is not None:
            extra.load_state_dict(state.get("extra", {}))

    address = os.environ.get(ADDRESS_ENV, LOOPBACK)
    pg = process_group_on(address, timedelta(seconds=t.ft))
    with manager_server_on(address):  # torchft's servers on the run's address only
        return Manager(
            pg=pg,
            # the healing state goes over the groups' own process group: no HTTP server of
            # torchft's (which would listen on every interface)
            checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=t.ft),
                                             device=torch.device("cpu")),
            load_state_dict=load_state_dict, state_dict=state_dict,
            min_replica_size=int(FtOptions.of(run.config).ft_min_replicas),
            use_async_quorum=False,  # heal before the forward pass, then train this step
            timeout=timedelta(seconds=t.ft), quorum_timeout=timedelta(seconds=t.quorum),
            connect_timeout=timedelta(seconds=t.connect),
            replica_id=f"distrun_replica{replica}",
            hostname=address,
            init_sync=False,  # every group seeds its model the same (--seed)
        )


def _meet(run: Any, replica: int, timeout: float) -> None:
    """The groups the launcher started together wait for each other's Manager (heartbeating)
    before their first quorum, so the first quorum holds them all (a restarted group finds
    everyone there already)."""
    spec = os.environ.get(BARRIER_ENV, "")
    if not spec:
        return
    folder, _, count = spec.rpartition(":")
    if run.strategy.rank == 0:
        open(os.path.join(folder, f"replica{replica}"), "w").close()
    deadline = time.monotonic() + timeout
    while len([f for f in os.listdir(folder) if f.startswith("replica")]) < int(count):
        if run.stop_signal is not None:
            return  # stopping: the loop's first check ends the fit
        if time.monotonic() > deadline:
            raise DistrunError(f"the replica groups did not all start within {timeout:g}s "
                               f"(--timeout); not all of the {count} did")
        time.sleep(0.05)


def _mark(name: str) -> None:
    """A file in the launcher's meeting folder (the launcher reads it)."""
    spec = os.environ.get(BARRIER_ENV, "")
    if spec:
        open(os.path.join(spec.rpartition(":")[0], name), "w").close()


def _marked(name: str) -> bool:
    """Whether the launcher left the file ``name`` in the meeting folder."""
    spec = os.environ.get(BARRIER_ENV, "")
    return bool(spec) and os.path.exists(os.path.join(spec.rpartition(":")[0], name))


def _resume_alone(run: Any, manager: Any, every: int) -> None:
    """No live peer to heal from: take the run's newest checkpoint (a peer may have committed
    a newer one since this group loaded its own at start), and torchft's step with it."""
    loaded = run.hook.distrun_load_checkpoint(run=run, source="auto")
    if loaded:
        run.resumed_from = loaded
        run.log.info("Resumed from %s at step %d (no live replica group to heal from)",
                     loaded, run.progress.step)
    manager.load_state_dict({"step": run.progress.step // every, "batches_committed": 0})


def _refuse_a_foreign_quorum(run: Any, manager: Any, replica: int) -> None:
    """One line and exit 2 when the quorum came from a lighthouse (or with a peer) of another
    torchft: otherwise every step fails to configure the process group, and the run loops on
    uncommitted steps. Rank 0 of this launcher's first group says it; the launcher stops the
    rest (the others wait here for that, at most the quorum timeout)."""
    from distrun_ft.binding import ForeignQuorum

    why = manager.errored()
    if why is None or not isinstance(why.original_exception, ForeignQuorum):
        return
    problem = UsageError(
        f"the torchft lighthouse at {os.environ.get(LIGHTHOUSE_ENV, '?')} (or a replica group "
        f"on another host) runs another torchft than this one ({TORCHFT_PIN}): "
        f"{why.original_exception}; run the lighthouse and every host on the same torchft "
        "(distrun starts the installed one's when --ft-lighthouse is left out)")
    first = int(FtOptions.of(run.config).ft_first_replica)
    if replica != first or run.strategy.rank != 0:
        time.sleep(timeouts(run.config).quorum)
    raise problem
