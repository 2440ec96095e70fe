"""Stash keys the core owns: values several plugins publish or read (see :mod:`.stash`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distrun._spec.stash import StashKey

if TYPE_CHECKING:
    from distrun._config.parallel_dims import ParallelDims

__all__ = ["COMPILE_TIME", "CONSOLE_OWNER", "DEVICE_MESH", "JOINABLES", "PARALLEL_DIMS", "STEP_SYNC",
           "UNEVEN_EPOCH"]

#: the run's ``torch.distributed.device_mesh.DeviceMesh``, set by mesh-building strategies
DEVICE_MESH: StashKey[Any] = StashKey("device_mesh")
#: the run's validated parallel degrees, set next to :data:`DEVICE_MESH`
PARALLEL_DIMS: StashKey[ParallelDims] = StashKey("parallel_dims")
#: more ``torch.distributed.algorithms.Joinable`` objects for uneven-input handling
JOINABLES: StashKey[list[Any]] = StashKey("joinables")
#: True while an epoch runs with ranks that may hold different batch counts (under Join):
#: the loop then keeps in-epoch validation for the end of the epoch
UNEVEN_EPOCH: StashKey[bool] = StashKey("uneven_epoch")
#: the name of the plugin that shows metrics its own way; the console line stays quiet then
CONSOLE_OWNER: StashKey[str] = StashKey("console_owner")
#: under ``--compile``, the core's clock of torch.compile time on this rank: its ``excluded``
#: seconds (a float: compiling, and steps' waits for other ranks' compiles) grow while
#: dynamo compiles, so a display can leave them out of its rate
COMPILE_TIME: StashKey[Any] = StashKey("compile_time")
#: the loop's step synchronizer (a ``Joinable``: stop votes and metric reductions at step
#: boundaries), for a plugin that joins the loop's collectives (Join)
STEP_SYNC: StashKey[Any] = StashKey("loop.step_sync")
