"""Keep torch's TorchScript deprecation notices about its own RPC internals out of sight.

``torch.distributed.optim`` scripts its functional optimizers at import (66 notices) and
``RemoteModule`` declares a ``torch.jit.interface``; torch attributes them to
``torch/jit/_script.py``, so no module filter can tell them apart from a user's own
``torch.jit.script`` call: we silence exactly these messages, only around our own calls.
``init_rpc`` also warns about its own use of a gloo backend. DistributedOptimizer's notice
about scripted functional optimizers cannot be filtered (torch forces it on): we avoid that
path altogether by giving it a plain optimizer factory (see ``server.OptimizerFactory``).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

__all__ = ["TORCHSCRIPT_NOTICES", "quiet_torchscript"]

#: the messages torch emits from torch/jit/_script.py; nothing else is filtered
TORCHSCRIPT_NOTICES = (
    r"`torch\.jit\.script` is deprecated",
    r"`torch\.jit\.interface` is deprecated",
)
#: init_rpc's own device-map exchange calls all_gather_object on a raw gloo backend
INIT_RPC_NOTICE = r"You are using a Backend .* as a ProcessGroup"


@contextlib.contextmanager
def quiet_torchscript() -> Iterator[None]:
    """Within the block, drop torch's TorchScript deprecation notices (and only those)."""
    with warnings.catch_warnings():
        for message in TORCHSCRIPT_NOTICES:
            warnings.filterwarnings("ignore", message=message, category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=INIT_RPC_NOTICE, category=UserWarning,
                                module=r"torch\.distributed\.")
        yield


def import_rpc_modules() -> None:
    """Import torch's RPC, distributed autograd and optim modules without the notices."""
    with quiet_torchscript():
        import torch.distributed.autograd  # noqa: F401
        import torch.distributed.nn.api.remote_module  # noqa: F401
        import torch.distributed.optim  # noqa: F401
        import torch.distributed.rpc  # noqa: F401
