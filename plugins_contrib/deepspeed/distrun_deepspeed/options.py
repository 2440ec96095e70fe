"""distrun-deepspeed's options, read typed with ``DeepSpeedOptions.of(config)`` (torch-free)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from distrun.plugin import PluginOptions, UsageError, option


@dataclass(frozen=True)
class DeepSpeedOptions(PluginOptions, plugin="deepspeed"):
    """The deepspeed strategy's options (``DeepSpeedOptions.of(config)``)."""

    ds_stage: int = option(
        2, "DeepSpeed ZeRO stage under --strategy deepspeed: 1 shards optimizer state, 2 also "
        "gradients, 3 also parameters", choices=(1, 2, 3))
    ds_config: str = option(
        "", "a DeepSpeed JSON config whose entries override the ones distrun derives (batch, "
        "accumulation, clipping, ZeRO stage)", metavar="FILE")


def user_config(config: Any) -> dict[str, Any]:
    """The ``--ds-config`` file's entries ({} without one); a usage error for a bad file.

    Torch-free: the launcher reads it before any worker starts, so a typo costs no start-up.
    """
    path = DeepSpeedOptions.of(config).ds_config
    if not path:
        return {}
    try:
        with open(path) as f:
            given = json.load(f)
    except OSError as exc:
        raise UsageError(f"--ds-config {path}: {exc.strerror} (give a DeepSpeed JSON config "
                         "file)") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"--ds-config {path}: not JSON ({exc.msg} at line {exc.lineno}); "
                         "give a DeepSpeed JSON config file") from None
    if not isinstance(given, dict):
        raise UsageError(f"--ds-config {path}: a JSON object is needed, not "
                         f"{type(given).__name__}")
    return given
