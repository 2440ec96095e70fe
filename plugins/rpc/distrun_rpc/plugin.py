"""Entry point of distrun-rpc (torch-free at import): options, the ``rpc`` strategy, hooks."""

from __future__ import annotations

from typing import Any

from distrun.plugin import StashKey, StrategyInfo, hookimpl
from distrun_rpc.options import RpcOptions

DISTRUN_PLUGIN_API = 1  # the distrun.plugin API this plugin is written for

PLUGIN = "rpc"
#: the run's RpcStrategy (roles, remote references), for the task and the plugin's hooks. It
#: lives here so that the hooks of a run with another strategy never import torch's RPC stack
#: (``torch.distributed.optim`` costs ~0.3 s of every start).
RPC_STRATEGY: StashKey[Any] = StashKey("rpc")


def _strategy(run: Any) -> Any:
    """This run's RpcStrategy on a trainer, else None (other strategies, server ranks)."""
    st = run.stash.get(RPC_STRATEGY)
    return st if st is not None and st.trains else None


@hookimpl
def distrun_register_options(register):
    register(RpcOptions)


@hookimpl
def distrun_register_strategies(register):
    register(StrategyInfo(PLUGIN, "distrun_rpc.strategy:RpcStrategy", plugin=PLUGIN,
                          help="parameter servers + trainers over torch RPC (sync, async, "
                               "RPC + DDP)"))


@hookimpl
def distrun_on_fit_start(run):
    st = _strategy(run)
    if st is not None:
        st.barrier()  # a restored server state is in place before any trainer steps
        st.refresh_local()


@hookimpl(tryfirst=True)
def distrun_on_fit_end(run):
    st = _strategy(run)
    if st is not None:
        st.refresh_local()  # before other plugins look: run.model holds the final parameters


@hookimpl
def distrun_state_dict(run):
    st = _strategy(run)
    if st is None:
        return None
    st.refresh_local()
    if st.dp_rank != 0:
        return None
    return {"rpc_servers": st.server_state()}


@hookimpl
def distrun_load_state_dict(run, state):
    st = _strategy(run)
    if st is not None and st.dp_rank == 0 and "rpc_servers" in state:
        st.load_server_state(state["rpc_servers"])


@hookimpl
def distrun_on_exception(run, exc):
    st = run.stash.get(RPC_STRATEGY)
    if st is not None:
        st.failed = True
