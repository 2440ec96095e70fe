"""What ``--ft`` refuses, and the timeout hierarchy it derives (torch-free).

The hierarchy, from the shortest: the lighthouse drops a group that sent no heartbeat for
``--ft-heartbeat`` H seconds; a cross-group collective (torchft's process group) and the
should-commit vote give up after :func:`timeouts`' ``ft`` seconds; a quorum waits at most
``quorum`` seconds; the collectives inside a group (``--timeout``) wait longest. A survivor
whose peer died in a cross-group collective therefore fails that step (it is retried) well
before its own group's timeout could end the run, and a group that died is out of the next
quorum after H seconds.
"""

from __future__ import annotations

import importlib.util
import socket
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from distrun.plugin import UsageError, local_address, resolve_nproc
from distrun_ft.options import FtOptions

__all__ = ["Timeouts", "check_launch", "lighthouse_here", "lighthouse_hostport", "sync_mode",
           "timeouts", "TORCHFT_PIN"]

#: the strategies a replica group may run: torchft's commit holds the optimizer step back
GROUP_STRATEGIES = ("auto", "single", "ddp", "fsdp")
#: why the others are refused
_UNSUPPORTED = {
    "deepspeed": "DeepSpeed's engine reduces the gradients and steps its optimizer itself, "
                 "so torchft never averages them across the groups and their weights drift "
                 "apart",
    "rpc": "its parameter servers and trainers are not replicas of one model",
    "dp": "one process driving every GPU: use ddp, one process per device",
    "tp": "tensor-parallel shards are not synced across the groups",
}
#: what ``pip install`` fixes a missing torchft with (the pin of pyproject.toml)
TORCHFT_PIN = "torchft-nightly==2026.10.26"


@dataclass(frozen=True)
class Timeouts:
    """Seconds, from the shortest: heartbeat < ft (cross-group ops) < quorum <= group."""

    heartbeat: float
    ft: float
    quorum: float
    group: float
    connect: float


def timeouts(config: Any) -> Timeouts:
    """The hierarchy for this run, or a UsageError naming what to change."""
    h = float(FtOptions.of(config).ft_heartbeat)
    group = float(config.timeout)
    ft = max(4.0 * h, 5.0)
    quorum = max(ft + h, group / 2)
    if not (h < ft < quorum <= group):
        raise UsageError(
            f"--timeout {group:g} is too short for --ft-heartbeat {h:g}: a group's collectives "
            f"must outlast a cross-group one ({ft:g}s) and a quorum ({ft + h:g}s); use "
            f"--timeout {2 * (ft + h):g} or more, or a shorter --ft-heartbeat")
    return Timeouts(heartbeat=h, ft=ft, quorum=quorum, group=group, connect=min(group, 30.0))


def sync_mode(config: Any) -> tuple[str, int]:
    """``--ft-sync`` as (mode, N): ("step", 1), ("localsgd", N) or ("diloco", N)."""
    text = str(FtOptions.of(config).ft_sync).strip()
    if not text:
        return "step", 1
    mode, _, every = text.partition(":")
    if mode not in ("localsgd", "diloco") or not every.isdigit() or int(every) < 1:
        raise UsageError(f"--ft-sync {text!r} is not localsgd:N or diloco:N (N >= 1 local "
                         "steps between syncs)")
    return mode, int(every)


def lighthouse_hostport(url: str) -> tuple[str, int]:
    """``http://HOST:PORT`` (or ``HOST:PORT``) as (host, port), or a UsageError."""
    parsed = urlparse(url if "://" in url else f"http://{url}")
    if not parsed.hostname or not parsed.port:
        raise UsageError(f"--ft-lighthouse {url!r} is not http://HOST:PORT")
    return parsed.hostname, parsed.port


def lighthouse_here(host: str, port: int) -> str | None:
    """The address this launcher serves the ``--ft-lighthouse`` on, or None when another host
    (or another launcher of this host) serves it: it serves it when its address is one of this
    host's and nothing listens on its port yet, as torchrun's rendezvous endpoint is served by
    the host it names."""
    address = local_address(host)
    if address is None:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((address, port))
        except OSError:
            return None  # taken: served already
    return address


def check_launch(config: Any) -> None:
    """Everything ``--ft`` refuses, each in one line, before anything starts."""
    if importlib.util.find_spec("torchft") is None:
        raise UsageError(f"--ft needs torchft: pip install '{TORCHFT_PIN}'")
    if int(config.get("max_restarts", 0) or 0) > 0:
        raise UsageError("--ft restarts a dead replica group by itself: use --ft-max-restarts "
                         "N instead of --max-restarts (which restarts the whole job)")
    if str(config.strategy).startswith("pp") or int(config.get("pp", 0) or 0) > 1:
        raise UsageError(f"--ft does not support pipeline parallelism (--strategy "
                         f"{config.strategy}): use ddp or fsdp inside each replica group")
    strategy = str(config.strategy)
    if strategy not in GROUP_STRATEGIES:
        why = _UNSUPPORTED.get(strategy, "the --ft loop syncs only the gradients of a ddp or "
                               "an fsdp group")
        raise UsageError(f"--ft does not support --strategy {strategy} ({why}): use ddp or "
                         "fsdp inside each replica group")
    degrees = {k: v for k, v in config.parallel_degrees().items() if int(v) > 1}
    if degrees:
        name, degree = next(iter(degrees.items()))
        raise UsageError(f"--ft does not support {name} parallelism ({name} degree {degree}): "
                         "each rank of a group must hold the model or an fsdp shard of it; "
                         f"leave the {name} degree out")
    if config.get("zero"):
        raise UsageError("--ft does not support --zero (ZeroRedundancyOptimizer steps and "
                         "re-broadcasts the weights itself, outside torchft's commit): use "
                         "--strategy fsdp to shard the optimizer state inside each group")
    if str(config.nnodes) not in ("1", "1:1"):
        raise UsageError("--ft starts this host's replica groups: run one `distrun run --ft "
                         "--ft-lighthouse URL` per host instead of --nnodes")
    nproc = resolve_nproc(config.nproc_per_node)
    opts = FtOptions.of(config)
    groups = int(opts.replica_groups)
    if int(config.batch_size) < groups * nproc:
        raise UsageError(f"--batch-size {config.batch_size} is smaller than the "
                         f"{groups * nproc} ranks of --replica-groups {groups} x "
                         f"--nproc-per-node {nproc}: every rank needs a sample per step")
    if int(opts.ft_min_replicas) > groups and not opts.ft_lighthouse:
        raise UsageError(f"--ft-min-replicas {opts.ft_min_replicas} is more than "
                         f"--replica-groups {groups}: no step could ever commit")
    timeouts(config)
    mode, every = sync_mode(config)
    cadence = int(config.get("ckpt_every_n_steps", 0) or 0)
    if mode != "step" and cadence % every:
        raise UsageError(f"--ckpt-every-n-steps {cadence} is not a multiple of --ft-sync "
                         f"{opts.ft_sync}: checkpoints are taken at syncs, where the groups' "
                         f"weights agree; use a multiple of {every}")
    if opts.ft_lighthouse:
        host, port = lighthouse_hostport(opts.ft_lighthouse)
        if lighthouse_here(host, port) is None:  # another host's (or launcher's): wait for it
            _reach(opts.ft_lighthouse, host, port, timeouts(config).connect)


def _reach(url: str, host: str, port: int, within: float) -> None:
    """Wait up to ``within`` seconds for the lighthouse (hosts start in any order), or a
    UsageError."""
    deadline = time.monotonic() + within
    while True:
        try:
            socket.create_connection((host, port), timeout=5.0).close()
            return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise UsageError(
                    f"cannot reach the torchft lighthouse at {url} within {within:g}s "
                    f"({exc.strerror or exc}): start the launcher of the host it names "
                    "(it serves it), or one with `torchft_lighthouse --min_replicas 1 --bind "
                    "HOST:PORT`, or leave --ft-lighthouse out") from None
        time.sleep(0.5)
