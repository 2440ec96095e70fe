"""What an elastic launch needs, worked out from the run config (torch-free).

The choices made here:

- the plugin answers ``distrun_launch`` when the config asks for elasticity: ``--max-restarts``
  above 0, a node range ``--nnodes MIN:MAX``, a rendezvous endpoint or ``--rdzv-conf``;
- a single-node run rendezvous on ``127.0.0.1`` (a free port), and so does a run whose endpoint
  is a loopback address;
- every server of the node (the rendezvous store on the endpoint's host, each attempt's store on
  the round's node 0, gloo) listens on the address :func:`distrun.plugin.bind_address`
  gives, never every interface: 127.0.0.1 on one node, else this node's address toward the
  endpoint's host (or ``--local-addr``), which torch's rendezvous also announces for the node
  (never the host name, which may resolve to the loopback);
- every start of the workers, first or restarted, resumes from the newest valid checkpoint: the
  launcher writes ``resume = "auto"`` into the values workers inherit (unless the user chose
  ``--resume`` themselves). Workers never look at ``TORCHELASTIC_RESTART_COUNT``: it counts the
  restarts of *this* node only, so nodes would disagree about whether to resume;
- with ``--rdzv-id`` and no ``--name``, the run is named after the rendezvous id so that every
  node (and every relaunch) shares one run folder and one checkpoint folder.
"""

from __future__ import annotations

import os
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from distrun.plugin import (
    RunConfig,
    UsageError,
    bind_address,
    free_port,
    run_key,
)
from distrun_elastic.options import ElasticOptions

__all__ = ["ElasticPlan", "make_plan", "parse_rdzv_conf", "split_endpoint", "wants_elastic"]

#: seconds the siblings of a failed worker get to exit before SIGKILL, when restarting
RESTART_GRACE = 5.0
_DEFAULT_NAME = re.compile(r".+-\d{8}-\d{6}")


def wants_elastic(config: RunConfig) -> bool:
    """True when the config asks for the elastic agent."""
    lo, hi = _node_range(config.nnodes)
    # torchrun's --rdzv-conf tunes a rendezvous: only the agent has one to tune.
    opts = ElasticOptions.of(config)
    return opts.max_restarts > 0 or lo != hi or bool(opts.rdzv_endpoint) or bool(opts.rdzv_conf)


@dataclass(frozen=True)
class ElasticPlan:
    """Everything :func:`distrun_elastic.launch.launch_elastic` hands to torch's agent."""

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    max_restarts: int
    rdzv_backend: str
    rdzv_endpoint: str
    run_id: str
    rdzv_configs: dict[str, Any] = field(default_factory=dict)
    monitor_interval: float = 0.1
    local_addr: str | None = None
    #: where this node's stores and gloo listen (distrun.plugin.bind_address; None: torch's default)
    bind_address: str | None = None
    log_dir: str = ""
    tee: bool = False
    debug: bool = False
    role: str = "default"
    #: TORCHELASTIC_SIGNALS_TO_HANDLE; empty: the plugin's own list
    signals: str = ""
    #: seconds without a heartbeat after which a node counts as lost (see liveness)
    heartbeat_timeout: float = 15.0
    #: fork the workers from a warm spare per local rank (distrun.plugin.WorkerGroup.spares)
    warm_restart: bool = True
    #: the config the workers take (resume, run name as the elastic launch sets them)
    config: Any = None
    #: the run's key, the same on every node of a multi-node run ("": the launcher's own)
    run_key: str = ""

    @property
    def heartbeat_interval(self) -> float:
        return min(2.0, self.heartbeat_timeout / 5)


def _node_range(nnodes: str) -> tuple[int, int]:
    parts = nnodes.split(":")
    try:
        lo, hi = int(parts[0]), int(parts[-1])
    except ValueError:
        lo = hi = 0
    if len(parts) > 2 or not 1 <= lo <= hi:
        raise UsageError(f"invalid value for --nnodes: {nnodes!r} (use N or MIN:MAX with MIN "
                         "at most MAX, e.g. 2 or 1:2)")
    return lo, hi


#: the ``--rdzv-conf`` keys torch's rendezvous handlers read (torch 2.13), by backend, and the
#: kind of value each takes: "seconds" and "count" a whole number above 0 (torch refuses 0 and
#: less, or hangs), "rank" one of 0 or more, "bool" one of torch's spellings
#: (``RendezvousParameters.get_as_bool``), "path" any text, a tuple one of its words.
#: c10d and etcd-v2: ``dynamic_rendezvous.create_handler`` and their backend's
#: ``create_backend``; static: ``static_tcp_rendezvous.create_rdzv_handler``; etcd:
#: ``etcd_rendezvous``. ``timeout`` is torchrun's, which it passes to every backend, and
#: ``is_host`` also tells distrun whether this node serves the rendezvous store.
_DYNAMIC = {"join_timeout": "seconds", "last_call_timeout": "seconds",
            "close_timeout": "seconds", "heartbeat_timeout": "seconds",
            "keep_alive_interval": "seconds", "keep_alive_max_attempt": "count",
            "read_timeout": "seconds", "timeout": "seconds"}
RDZV_CONF_KEYS: dict[str, dict[str, Any]] = {
    "c10d": {**_DYNAMIC, "is_host": "bool", "store_type": ("tcp", "file")},
    "static": {"timeout": "seconds", "rank": "rank", "is_host": "bool"},
    "etcd": {"timeout": "seconds", "last_call_timeout": "seconds",
             "protocol": ("http", "https"), "cert": "path", "key": "path", "cacert": "path",
             "etcd_prefix": "path"},
    "etcd-v2": {**_DYNAMIC, "protocol": ("http", "https"), "ssl_cert": "path",
                "ssl_cert_key": "path", "ca_cert": "path"},
}
_TRUE = ("1", "true", "t", "yes", "y")
_FALSE = ("0", "false", "f", "no", "n")
_KINDS = {"seconds": "a whole number of seconds above 0", "count": "a whole number above 0",
          "rank": "a whole number, 0 or more",
          "bool": "one of " + ", ".join(_TRUE + _FALSE)}
_EXAMPLES = {"seconds": 60, "count": 3, "rank": 0, "bool": "true"}


def parse_rdzv_conf(text: str, backend: str = "c10d") -> dict[str, Any]:
    """``"last_call_timeout=5,is_host=true"`` -> a dict (torchrun's ``--rdzv-conf`` format),
    each key one ``backend``'s rendezvous reads and each value of its kind."""
    out: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(
                f"invalid value for --rdzv-conf: {item!r} is not KEY=VALUE "
                "(example: --rdzv-conf last_call_timeout=5,join_timeout=600)"
            )
        key, value = key.strip(), value.strip()
        _check_rdzv_value(backend, key, value)
        out[key] = value
    return out


def _check_rdzv_value(backend: str, key: str, value: str) -> None:
    """Raise a UsageError naming ``key`` when torch's ``backend`` rendezvous would not take it."""
    known = RDZV_CONF_KEYS.get(backend, {})
    kind = known.get(key)
    if kind == "path":
        return
    if kind is None:
        raise UsageError(
            f"invalid value for --rdzv-conf: unknown key {key!r} for the {backend} rendezvous "
            f"(known: {', '.join(sorted(known))})")
    if isinstance(kind, tuple):
        if value.lower() in kind:
            return
        allowed = "one of " + ", ".join(kind)
    elif kind == "bool":
        if value.lower() in _TRUE + _FALSE:
            return
        allowed = _KINDS[kind]
    else:
        lowest = 0 if kind == "rank" else 1
        if re.fullmatch(r"[+-]?\d+", value) and int(value) >= lowest:
            return
        allowed = _KINDS[kind]
    raise UsageError(f"invalid value for --rdzv-conf: {key}={value!r} (use {allowed}, e.g. "
                     f"{key}={_EXAMPLES.get(kind, kind[0] if isinstance(kind, tuple) else 1)})")


def split_endpoint(endpoint: str) -> tuple[str, str]:
    """``"host:port"`` (or ``"[v6]:port"``) -> (host, port)."""
    host, sep, port = endpoint.rpartition(":")
    if not sep:
        return endpoint, ""
    return host.strip("[]"), port


def make_plan(config: RunConfig, environ: dict[str, str]) -> tuple[ElasticPlan, RunConfig]:
    """The launch plan and the config workers get (resume, run name); updates ``environ``."""
    from distrun.plugin import resolve_nproc

    lo, hi = _node_range(config.nnodes)
    opts = ElasticOptions.of(config)
    for flag, value, default in (("--redirects", config.redirects, "0"),
                                 ("--local-ranks-filter", config.local_ranks_filter, "")):
        if value != default:
            raise UsageError(f"{flag} is not supported under the elastic agent yet (drop it, or "
                             "run without --max-restarts/--rdzv-endpoint/a node range)")
    # Written by the agent: only where the user asked for files, else torch's temporary folder.
    log_dir = config.log_dir or (os.path.join(config.run_dir, "logs") if config.run_dir else "")
    backend = opts.rdzv_backend
    endpoint = opts.rdzv_endpoint.strip()
    conf = parse_rdzv_conf(opts.rdzv_conf, backend)
    if backend == "static":
        if lo != hi:
            raise UsageError(f"--nnodes {config.nnodes}: a node range needs a dynamic rendezvous "
                             "(use --rdzv-backend c10d)")
        if not endpoint:
            if hi > 1 and config.master_port == 0:
                raise UsageError("--rdzv-backend static with several nodes needs --master-port "
                                 "(or --rdzv-endpoint HOST:PORT), the same on every node")
            port = config.master_port or free_port()
            endpoint = f"{config.master_addr}:{port}"
        conf.setdefault("rank", str(config.node_rank))
    elif not endpoint:
        if hi > 1:
            raise UsageError(
                f"--nnodes {config.nnodes} needs --rdzv-endpoint HOST:PORT: the address every "
                "node can reach (the node at HOST hosts the rendezvous)"
            )
        endpoint = "127.0.0.1:0"
    explicit_name = not _is_default_name(config)
    run_id = opts.rdzv_id or (config.name if explicit_name else "")
    if not run_id:
        if hi > 1:
            raise UsageError(
                f"--nnodes {config.nnodes} needs --rdzv-id ID (or --name): the same on every "
                "node, so the nodes find each other and share one run folder"
            )
        run_id = uuid.uuid4().hex[:12]
    updates: dict[str, Any] = {}
    if opts.rdzv_id and not explicit_name:
        updates.update(name=opts.rdzv_id, run_dir=os.path.join("runs", opts.rdzv_id))
    if "resume" not in config.sources:
        updates["resume"] = "auto"
    if updates:
        config = config.with_values(source="elastic", **updates)
    # the nodes of one run share its folders: one key for their locks
    key = run_key(shared=(run_id, endpoint)) if hi > 1 else ""
    host, _ = split_endpoint(endpoint)
    # where this node's servers listen; on one node it is also the address workers meet at
    bind = bind_address(hi, host, config.local_addr)
    # the address torch announces for this node: where its servers listen (never its host
    # name, which may resolve to the loopback)
    local_addr = bind
    plan = ElasticPlan(
        min_nodes=lo, max_nodes=hi, nproc_per_node=resolve_nproc(config.nproc_per_node),
        max_restarts=opts.max_restarts, rdzv_backend=backend, rdzv_endpoint=endpoint,
        run_id=run_id, rdzv_configs=conf, monitor_interval=opts.monitor_interval,
        local_addr=local_addr, bind_address=bind, log_dir=log_dir, tee=config.tee,
        debug=config.debug,
        role=config.role,
        signals=config.signals_to_handle if "signals_to_handle" in config.sources else "",
        heartbeat_timeout=opts.heartbeat_timeout,
        warm_restart=opts.warm_restart, config=config, run_key=key,
    )
    return plan, config


def _is_default_name(config: RunConfig) -> bool:
    """True when the core named the run (``STEM-YYYYmmdd-HHMMSS``), not the user.

    The core's launcher records its filled-in name with the same provenance as a flag, so the
    name's shape is what tells them apart.
    """
    return bool(_DEFAULT_NAME.fullmatch(config.name)) and \
        config.run_dir in ("", os.path.join("runs", config.name))
