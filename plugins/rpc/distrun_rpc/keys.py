"""Stash keys of distrun-rpc (torch-free, so the entry point can read them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from distrun import StashKey

if TYPE_CHECKING:
    from distrun_rpc.strategy import RpcStrategy

__all__ = ["RPC_STRATEGY"]

#: the run's RPC strategy (roles, remote references), for the task and other hooks
RPC_STRATEGY: StashKey[RpcStrategy] = StashKey("rpc")
