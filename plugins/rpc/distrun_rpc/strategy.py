"""``RpcStrategy``: parameter servers and trainers over torch.distributed.rpc (TensorPipe).

Every rank joins one RPC group (workers ``trainer0..`` and ``server0..``). Trainers also form
a gloo process group of their own, which is the run's default group: the loop, the data
cursor, metrics and checkpoints see a world of trainers only. A server builds its shard from
the task, then serves inside ``setup`` until every trainer has said it is done, and reports
``trains = False`` so the core skips the loop on it.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from distrun.plugin import BaseStrategy, DistrunError, RunConfig, UsageError
from distrun_rpc import server
from distrun_rpc.models import HybridModel, RemoteOptimizer, ServerParamsModel, optimizer_spec
from distrun_rpc.options import RpcOptions
from distrun_rpc.plugin import RPC_STRATEGY
from distrun_rpc.quiet import import_rpc_modules, quiet_torchscript
from distrun_rpc.roles import Roles, assign_shards

if TYPE_CHECKING:
    from distrun.plugin import Run

__all__ = ["RpcPeerError", "RpcStrategy"]

import_rpc_modules()
import torch.distributed.autograd as dist_autograd  # noqa: E402
import torch.distributed.rpc as rpc  # noqa: E402

#: seconds a failing rank waits to tell the servers, before it gives up on them
NOTIFY_TIMEOUT = 5.0


class RpcPeerError(DistrunError):
    """Another rank of the RPC group failed or stopped answering (exit code 1, one line)."""


class RpcStrategy(BaseStrategy):
    """``--strategy rpc``: ``--rpc-servers S`` parameter servers (the last ranks), the rest train.

    Modes: ``sync`` (distributed autograd + DistributedOptimizer on the servers), ``async``
    (trainers push gradients, servers average ``--rpc-update-batch`` of them per update and
    answer with fresh parameters) and, when the task has ``configure_remote()``, RPC + DDP.
    """

    name = "rpc"

    def __init__(self, config: RunConfig) -> None:
        super().__init__(config)
        self.global_world = self.world_size
        self.opts = RpcOptions.of(config)
        self.roles = Roles.of(self.rank, self.global_world, self.opts.rpc_servers)
        self.mode = self.opts.rpc_mode
        self.trains = not self.roles.is_server
        if self.trains:  # the loop's world is the trainers
            self.world_size = self.roles.trainers
            self.dp_rank, self.dp_world_size = self.rank, self.world_size
        self.failed = False
        self.shard_names: dict[int, list[str]] = {}
        self.local_model: torch.nn.Module | None = None
        self.dist_optimizer: Any = None
        self._ctx: Any = None
        self._ctx_id: int | None = None
        self._rpc_up = False
        self._hybrid: HybridModel | None = None

    # -- setup ---------------------------------------------------------------------------
    def setup(self, run: Run) -> None:
        cfg = self.config
        if cfg.device == "cuda":
            raise UsageError("--strategy rpc runs on CPU in this version (use --device cpu)")
        if "MASTER_ADDR" not in os.environ:
            raise UsageError("--strategy rpc needs several processes: start them with "
                             "`distrun run --nproc-per-node N ...` (MASTER_ADDR is not set)")
        if hasattr(run.task, "configure_remote"):
            if self.mode == "async":
                raise UsageError("a task with configure_remote() trains with RPC + DDP, which "
                                 "is synchronous (drop --rpc-mode async)")
            if self.roles.servers != 1:
                raise UsageError("RPC + DDP places the task's remote module on one server "
                                 "(use --rpc-servers 1)")
            self.mode = "ddp"
        if cfg.grad_clip > 0 and self.mode != "async":
            raise UsageError(f"--grad-clip needs local gradients; in rpc {self.mode} mode they "
                             "live in distributed autograd (use --rpc-mode async or drop it)")
        run.stash[RPC_STRATEGY] = self
        self.roles.export()
        r = self.roles
        print(f"distrun-rpc: rank {self.rank} is {r.role} {r.role_rank} of {r.role_world_size} "
              f"({self.mode} mode, {r.trainers} trainers, {r.servers} servers)", flush=True)
        state = self._build_server_state(run) if r.is_server else None
        server.install(state)  # before init_rpc: trainers can call us once it returns
        self._init_rpc()
        if state is not None:
            self._serve(state)
        else:
            self._join_trainers()

    def _init_rpc(self) -> None:
        addr, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
        options = rpc.TensorPipeRpcBackendOptions(
            num_worker_threads=max(8, 2 * self.global_world),
            rpc_timeout=self.opts.rpc_timeout,
            init_method=f"tcp://{addr}:{port}",
        )
        with quiet_torchscript():
            rpc.init_rpc(self.roles.name, rank=self.rank, world_size=self.global_world,
                         rpc_backend_options=options)
        self._rpc_up = True

    def _join_trainers(self) -> None:
        # A second client of the RPC rendezvous store (hosted by rank 0, a trainer) gives the
        # trainers their own group (--backend's, gloo by default) without another port.
        from distrun.plugin import join_process_group

        cfg = self.config
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              is_master=False, timeout=datetime.timedelta(seconds=cfg.timeout))
        self._owns_group = join_process_group(
            cfg, store=dist.PrefixStore("distrun_rpc_trainers", store), rank=self.rank,
            world_size=self.world_size, device_type="cpu")

    def _build_server_state(self, run: Run) -> server.ServerState:
        from distrun.plugin import seed_everything

        index = self.roles.role_rank
        batch = self.opts.rpc_update_batch or self.roles.trainers
        state = server.ServerState(index, self.roles.trainers, update_batch=batch)
        seed_everything(self.config.seed)
        if self.mode == "ddp":
            state.module = run.task.configure_remote()
            state.optimizer = run.task.configure_optimizer(list(state.module.parameters()))
            return state
        named = list(run.task.configure_model().named_parameters())
        owner = assign_shards([p.numel() for _, p in named], self.roles.servers)
        mine = [(n, p) for (n, p), o in zip(named, owner) if o == index]
        state.names = [n for n, _ in mine]
        state.params = [p for _, p in mine]
        if state.params:
            state.optimizer = run.task.configure_optimizer(state.params)
        return state

    def _serve(self, state: server.ServerState) -> None:
        while not state.done.wait(0.2):  # RPC threads do the work
            pass
        if state.failed:
            self.failed = True
            names = ", ".join(self.roles.describe(t) for t in state.failed)
            raise RpcPeerError(f"{names} stopped with an error, so "
                               f"{self.roles.describe(self.roles.name)} stops too")

    # -- model and optimizer on trainers --------------------------------------------------
    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        model = model.to(self.device)
        self.local_model = model
        if self.mode == "ddp":
            from torch.distributed.nn.api.remote_module import RemoteModule
            from torch.nn.parallel import DistributedDataParallel

            rref = self.call(0, server.module_rref)
            with quiet_torchscript():
                remote = RemoteModule.init_from_module_rref(f"{self.roles.server_name(0)}/cpu",
                                                            rref)
            self._hybrid = HybridModel(remote, DistributedDataParallel(model), self)
            return self._hybrid
        named = list(model.named_parameters())
        owner = assign_shards([p.numel() for _, p in named], self.roles.servers)
        self.shard_names = {i: [n for (n, _), o in zip(named, owner) if o == i]
                            for i in range(self.roles.servers)}
        if self.mode == "async":
            self.refresh_local()
            return model
        return ServerParamsModel(model, self)

    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return self.local_model if self.local_model is not None else model

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> Any:
        if self.mode == "async":
            return RemoteOptimizer(optimizer, self._async_step)
        from torch.distributed.optim import DistributedOptimizer

        if self.mode == "ddp":
            model = self.local_model
            rrefs = list(self._hybrid.remote.remote_parameters())
            rrefs += [rpc.RRef(p) for p in model.parameters()]
            server.install_trainer_optimizer(optimizer)  # steps the dense part (see factory)
        else:
            rrefs = []
            for i in range(self.roles.servers):
                rrefs += self.call(i, server.param_rrefs)
        cls, kwargs = optimizer_spec(optimizer)
        with quiet_torchscript(), _quiet_logger("torch.distributed.optim.optimizer"):
            self.dist_optimizer = DistributedOptimizer(server.OptimizerFactory(cls, kwargs), rrefs)
        return RemoteOptimizer(optimizer, self._dist_step)

    # -- per step -------------------------------------------------------------------------
    def open_context(self) -> int:
        """The step's distributed autograd context (opened by the first forward of a step)."""
        if self._ctx is None:
            self._ctx = dist_autograd.context()
            self._ctx_id = self._ctx.__enter__()
        return self._ctx_id

    def close_context(self) -> None:
        if self._ctx is not None:
            ctx, self._ctx, self._ctx_id = self._ctx, None, None
            ctx.__exit__(None, None, None)

    def backward(self, loss: torch.Tensor) -> None:
        if self.mode == "async":
            loss.backward()
            return
        if self._ctx_id is None:
            raise RuntimeError("rpc: backward without a forward in training mode this step")
        dist_autograd.backward(self._ctx_id, [loss])

    def _dist_step(self) -> None:
        if self._ctx_id is None:
            return
        try:
            self.dist_optimizer.step(self._ctx_id)
        except RuntimeError as exc:
            raise RpcPeerError(f"the optimizer step on the parameter servers failed: "
                               f"{_first_line(exc)}") from exc
        finally:
            self.close_context()

    def _async_step(self) -> None:
        local = dict(self.local_model.named_parameters())
        futures = {}
        for i, names in self.shard_names.items():
            grads = [local[n].grad for n in names]
            futures[i] = rpc.rpc_async(self.roles.server_name(i), server.push_grads,
                                       args=(grads,))
        for i, fut in futures.items():
            self._copy_into(local, self.shard_names[i], self.wait(i, fut))

    def pull_params(self, autograd: bool) -> dict[str, torch.Tensor]:
        """Every parameter from its server; recorded by distributed autograd when asked."""
        fn = server.pull if autograd else server.pull_values
        if autograd:
            self.open_context()
        futures = {i: rpc.rpc_async(self.roles.server_name(i), fn)
                   for i in self.shard_names if self.shard_names[i]}
        out: dict[str, torch.Tensor] = {}
        for i, fut in futures.items():
            out.update(zip(self.shard_names[i], self.wait(i, fut)))
        return out

    def refresh_local(self) -> None:
        """Copy the servers' current parameters into this trainer's local module."""
        if self.mode == "ddp" or self.local_model is None:
            return
        values = self.pull_params(autograd=False)
        self._copy_into(dict(self.local_model.named_parameters()), list(values),
                        list(values.values()))

    @staticmethod
    def _copy_into(local: Mapping[str, torch.Tensor], names: list[str], values: Any) -> None:
        with torch.no_grad():
            for name, value in zip(names, values):
                local[name].copy_(value)

    # -- talking to servers ---------------------------------------------------------------
    def call(self, index: int, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on server ``index``, within ``--rpc-timeout``; errors name the server."""
        return self.wait(index, rpc.rpc_async(self.roles.server_name(index), fn, args=args))

    def wait(self, index: int, fut: Any) -> Any:
        try:
            return fut.wait()
        except RuntimeError as exc:
            who = self.roles.describe(self.roles.server_name(index))
            raise RpcPeerError(f"{who} did not answer {self.roles.describe(self.roles.name)}: "
                               f"{_first_line(exc)}") from exc

    def server_state(self) -> dict[str, Any]:
        """Every server's parameters, optimizer state (both by parameter name, so the layout
        of servers may change between save and load) and the remote module's state."""
        parts = [self.call(i, server.state_dict) for i in range(self.roles.servers)]
        state: dict[str, Any] = {"servers": self.roles.servers, "mode": self.mode,
                                 "params": {}, "optimizer": {"state": {}, "hyper": []}}
        for part in parts:
            state["params"].update(part.get("params", {}))
            optim = part.get("optimizer")
            if optim is not None:
                state["optimizer"]["state"].update(optim["state"])
                state["optimizer"]["hyper"] = state["optimizer"]["hyper"] or optim["hyper"]
            if "module" in part:
                state["module"] = part["module"]
        return state

    def load_server_state(self, state: Mapping[str, Any]) -> None:
        params = state.get("params") or {}
        optim = state.get("optimizer") or {}
        for i in range(self.roles.servers):
            names = self.shard_names.get(i, [])
            part: dict[str, Any] = {"params": {n: params[n] for n in names if n in params}}
            if optim.get("hyper"):
                saved = optim.get("state", {})
                keep = names if self.mode != "ddp" else list(saved)
                part["optimizer"] = {"state": {n: saved[n] for n in keep if n in saved},
                                     "hyper": optim["hyper"]}
            if "module" in state and i == 0:
                part["module"] = state["module"]
            self.call(i, server.load_state_dict, part)

    # -- teardown -------------------------------------------------------------------------
    def teardown(self) -> None:
        if not self._rpc_up:
            super().teardown()
            return
        self.close_context()
        try:
            if self.trains:
                self._notify_servers()
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        super().teardown()
        self._rpc_up = False
        try:
            if self.failed:
                rpc.shutdown(graceful=False)
            else:
                rpc.shutdown(graceful=True, timeout=float(self.config.timeout))
        finally:
            server.install(None)
            server.install_trainer_optimizer(None)

    def _notify_servers(self) -> None:
        timeout = NOTIFY_TIMEOUT if self.failed else self.opts.rpc_timeout
        futures = [rpc.rpc_async(self.roles.server_name(i), server.trainer_done,
                                 args=(self.roles.name, self.failed), timeout=timeout)
                   for i in range(self.roles.servers)]
        for i, fut in enumerate(futures):
            try:
                fut.wait()
            except RuntimeError as exc:
                if not self.failed:
                    self.failed = True
                    raise RpcPeerError(
                        f"{self.roles.describe(self.roles.server_name(i))} did not answer at "
                        f"the end of training: {_first_line(exc)}") from exc


@contextlib.contextmanager
def _quiet_logger(name: str) -> Iterator[None]:
    """Drop one torch logger's records for the block (DistributedOptimizer's note that a
    non-TorchScript optimizer may be slow under the GIL: ours steps under a lock anyway)."""
    logger = logging.getLogger(name)
    previous = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = previous


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
