"""Test-only strategies for the safetensors tests, so they run with core + this plugin alone.

``st_ddp`` is the base strategy plus a gradient all-reduce (a replica per rank, like DDP);
``st_fsdp`` shards the model with FSDP2's ``fully_shard`` (DTensor Shard(0) parameters).
Loaded with ``DISTRUN_PLUGINS=st_plugin`` or ``Trainer(plugins=(st_plugin,))``.
``ST_KILL_AT=k@rank`` / ``ST_KILL_LAUNCHER_AT=k@rank`` kill (-9) that rank / its launcher at
the k-th durable point of the rank's saves. ``ST_SAVE=path`` makes rank 0 write the final full weights there (safetensors) at fit end;
``ST_DUMP=path`` the full model and optimizer tensors; ``ST_DUMP_START=path`` the full model
tensors at the start of the fit (after --init-weights or a resume). ``ST_LOAD_ALL=ckpt1,ckpt2,...`` with
``ST_OUT=dir`` loads each checkpoint through the hooks at fit start, dumps the full tensors to
``dir/<i>.safetensors`` and skips training (the layout matrix through real strategy plugins).
"""

from __future__ import annotations

import os

from distrun.plugin import StrategyInfo, hookimpl


def _make_ddp(config):
    import torch.distributed as dist

    from distrun.plugin import BaseStrategy

    class ReplicaStrategy(BaseStrategy):
        name = "st_ddp"

        def wrap_model(self, model):
            self._model = model.to(self.device)
            return self._model

        def optimizer_step(self, optimizer):
            if self.distributed:
                for p in self._model.parameters():
                    if p.grad is not None:
                        dist.all_reduce(p.grad)
                        p.grad /= self.world_size
            optimizer.step()

    return ReplicaStrategy(config)


def _make_fsdp(config):
    from distrun.plugin import BaseStrategy

    class ShardStrategy(BaseStrategy):
        name = "st_fsdp"

        def wrap_model(self, model):
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (self.world_size,))
            for child in model.children():
                if any(True for _ in child.parameters()):
                    fully_shard(child, mesh=mesh)
            return fully_shard(model, mesh=mesh)

    return ShardStrategy(config)


def kill_at(k: int, pid: int | None = None) -> None:
    """SIGKILL this process (or ``pid``) at the k-th durable point of its checkpoint saves."""
    import signal

    from distrun_safetensors.files import observe_durable

    seen = [0]

    def count(what: str) -> None:
        seen[0] += 1
        if seen[0] == k:
            os.kill(pid or os.getpid(), signal.SIGKILL)

    observe_durable(count)


@hookimpl
def distrun_configure(config):
    # ST_KILL_AT=k@rank: that rank dies at the k-th durable point of its saves;
    # ST_KILL_LAUNCHER_AT=k@rank: that rank kills its launcher (kill -9) there instead
    for name in ("ST_KILL_AT", "ST_KILL_LAUNCHER_AT"):
        spec = os.environ.get(name)
        if spec:
            at, _, rank = spec.partition("@")
            if not rank or rank == os.environ.get("RANK", "0"):
                launcher = int(os.environ["DISTRUN_LAUNCHER_PID"]) if "LAUNCHER" in name \
                    else None
                kill_at(int(at), launcher)


@hookimpl
def distrun_register_strategies(register):
    register(StrategyInfo("st_ddp", _make_ddp, help="test: replicas + grad all-reduce",
                          plugin="st_plugin"))
    register(StrategyInfo("st_fsdp", _make_fsdp, help="test: FSDP2 fully_shard",
                          plugin="st_plugin"))


def final_weights(run):
    out = {}
    for k, v in run.unwrapped_model().state_dict().items():
        out[k] = v.full_tensor() if hasattr(v, "full_tensor") else v.detach().clone()
    return out


@hookimpl
def distrun_on_fit_end(run):
    path = os.environ.get("ST_SAVE")
    if path:
        weights = final_weights(run)
        if run.is_global_zero:
            from safetensors.torch import save_file

            save_file(weights, path)


def full_state(run):
    """Model and optimizer tensors gathered to full tensors (collective: every rank calls)."""
    out = {f"model/{k}": v for k, v in final_weights(run).items()}
    model, opt = run.unwrapped_model(), run.optimizer
    for name, p in model.named_parameters():
        for k, v in sorted(opt.state.get(p, {}).items()):
            if hasattr(v, "full_tensor"):
                v = v.full_tensor()
            if hasattr(v, "detach"):
                out[f"optim/{name}/{k}"] = v.detach().clone().contiguous()
    return out


def _dump(run, path):
    tensors = full_state(run)
    if run.is_global_zero:
        from safetensors.torch import save_file

        save_file(tensors, path)


@hookimpl
def distrun_on_fit_start(run):
    start = os.environ.get("ST_DUMP_START")  # the weights training starts from (full tensors)
    if start:
        weights = final_weights(run)
        if run.is_global_zero:
            from safetensors.torch import save_file

            save_file(weights, start)
    sources = os.environ.get("ST_LOAD_ALL")
    if not sources:
        return
    for i, source in enumerate(sources.split(",")):
        run.hook.distrun_load_checkpoint(run=run, source=source)
        _dump(run, os.path.join(os.environ["ST_OUT"], f"{i}.safetensors"))
    run.done = True


@hookimpl(trylast=True)
def distrun_teardown(run):
    path = os.environ.get("ST_DUMP")
    if path and run.optimizer is not None and not os.environ.get("ST_LOAD_ALL"):
        _dump(run, path)
